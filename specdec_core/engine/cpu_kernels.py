"""Our own CPU kernels (`csrc/kernels.c`): attention for every sequence of a batch in one call, RMS
normalization, and the rotary embedding with the KV pool writes; used by the model's own forward
too, so that every path computes a position the same way.

Why: exactness and speed.
- SDPA's CPU kernels take one path for a single query row and another for a masked block of rows:
  a position's logits from a verify pass of 6 tokens differed from the same position decoded alone
  by 3e-5 (SmolLM2, fp32). A greedy verdict could then, at a near tie, differ from what the target
  alone decodes. Our kernel computes each query row on its own, in the same order whatever else is
  in the call (other sessions, other rows of its block, the thread count): decode, verify and
  prefill give a position the same bits, and a batch changes nothing.
- a decode step of 8 sessions called SDPA 240 times (one per session and layer, ~38 us each); the
  kernel takes every session of a layer in one call. RMS normalization (7 PyTorch operations) and
  the rotary embedding with the pool writes (6) are one call each, where a decode step is mostly
  the Python and dispatch around small operations.

The kernel is C compiled here at first use with the system's C compiler (`cc`, or $CC; AVX2/FMA
when the CPU has them) into the cache directory, and called through ctypes: no build step at
install. `load(options)` compiles and loads it once per process (transformers' registry of
attention implementations, where `enable` puts it, is process-wide too); `library()` is what it
loaded. Where no compiler works, or with `EngineOptions.cpu_attention` off, models keep SDPA and
their own norms.

`enable(model)` (called by `models.load_causal_lm` for CPU float32 models) registers the attention
kernel as the model's attention implementation `specdec-cpu`, which transformers then calls for the
model's own forward (`generate`, the tests' reference decodes), and swaps its RMS norms' forward for
the kernel's; `BatchedBackend` sees that implementation and runs its batches through `Batch`, and
the lean pass uses `rope_write`, which gives PyTorch's own bits (elementwise, rounded the same way).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import types
from pathlib import Path

import torch

from specdec_core.engine.options import EngineOptions

log = logging.getLogger(__name__)

NAME = "specdec-cpu"  # the attention implementation's name in transformers' registry
_SOURCE = Path(__file__).parent / "csrc" / "kernels.c"
_I64, _P = ctypes.c_int64, ctypes.c_void_p


def _isa_flags() -> list[str]:
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return []
    return ["-mavx2", "-mfma"] if "avx2" in flags and "fma" in flags else []


def _compile(cache_dir: Path) -> Path | None:
    """The kernel's shared library, compiled once per source, compiler and flags (None: no compiler)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    source = _SOURCE.read_bytes()
    base = ["-O3", "-fPIC", "-shared", "-ffp-contract=off"]
    for flags in ([*base, "-fopenmp", *_isa_flags()], [*base, *_isa_flags()]):
        try:
            version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        key = hashlib.sha256(source + " ".join([cc, version, *flags]).encode()).hexdigest()[:16]
        target = cache_dir / f"kernels-{key}.so"
        if target.exists():
            return target
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
            built = Path(tmp) / target.name
            done = subprocess.run([cc, *flags, "-o", str(built), str(_SOURCE)], capture_output=True, text=True,
                                  timeout=300)
            if done.returncode == 0:
                os.replace(built, target)  # atomic: processes starting together each build, one file stays
                return target
            log.debug("compiling the attention kernel with %s failed: %s", flags, done.stderr[-2000:])
    return None


_loaded: dict[str, ctypes.CDLL | None] = {}  # "library": what the first `load` of this process got


def load(options: EngineOptions) -> ctypes.CDLL | None:
    """The kernel library, compiled under `options.cache_dir` and loaded by the first call in this
    process (later calls return that one); None with `options.cpu_attention` off, or where it cannot
    be had (then SDPA serves)."""
    if not options.cpu_attention:
        return None
    if "library" not in _loaded:
        _loaded["library"] = _open(options.cache_dir / "kernels")
    return _loaded["library"]


def library() -> ctypes.CDLL | None:
    """The library `load` loaded in this process (None before any `load`, or where it failed)."""
    return _loaded.get("library")


def _open(cache_dir: Path) -> ctypes.CDLL | None:
    try:
        path = _compile(cache_dir)
        lib = ctypes.CDLL(str(path)) if path is not None else None
    except OSError:
        log.warning("could not load the CPU attention kernel", exc_info=True)
        lib = None
    if lib is None:
        log.warning("no C compiler could build the CPU attention kernel: attention stays on SDPA")
        return None
    lib.specdec_attention.restype = ctypes.c_int
    lib.specdec_attention.argtypes = [_P, _I64, _I64, _P, _P, _I64, _P, _I64, _I64, _I64, ctypes.c_float, _I64,
                                      _P, _P, _P, _P, _P]
    lib.specdec_rms_norm.restype = None
    lib.specdec_rms_norm.argtypes = [_P, _P, _P, _I64, _I64, ctypes.c_float]
    lib.specdec_rope_write.restype = None
    lib.specdec_rope_write.argtypes = [_P, _P, _P, _I64, _I64, _I64, _I64, _P, _P, _I64, _P]
    lib.specdec_quantized_available.restype = ctypes.c_int
    lib.specdec_quantized_available.argtypes = []
    lib.specdec_quantized_linear.restype = ctypes.c_int
    lib.specdec_quantized_linear.argtypes = [ctypes.c_int, _P, _I64, _I64, _I64, _P, _P, _P, _I64, _P, _P, _P,
                                             ctypes.c_int]
    lib.specdec_int8_available.restype = ctypes.c_int
    lib.specdec_int8_available.argtypes = []
    lib.specdec_quantized_linear_int8.restype = ctypes.c_int
    lib.specdec_quantized_linear_int8.argtypes = lib.specdec_quantized_linear.argtypes
    return lib


def supports(model) -> bool:
    """Whether the kernel can serve this model: CPU, float32, a head size of a multiple of 8."""
    param = next(model.parameters(), None)
    head_dim = getattr(model.config, "head_dim", None) or (
        model.config.hidden_size // model.config.num_attention_heads)
    return (param is not None and param.device.type == "cpu" and param.dtype == torch.float32
            and head_dim % 8 == 0 and head_dim <= 512 and library() is not None)


def enable(model) -> bool:
    """Make the kernel the model's attention implementation (its own forward and BatchedBackend's
    batches); whether it did."""
    if not supports(model):
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # None where causality alone decides (the usual case)
    model.set_attn_implementation(NAME)
    for m in model.modules():
        if is_rms_norm(m):
            m.forward = types.MethodType(_rms_norm_forward(type(m).forward), m)
    return True


RMS_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm")


def is_rms_norm(m) -> bool:
    """A Llama-style RMSNorm: a weight and an epsilon, nothing else (Gemma's 1 + weight has another forward)."""
    return (type(m).__name__ in RMS_NORMS and hasattr(m, "variance_epsilon") and isinstance(m.weight, torch.Tensor)
            and not list(m.children()))


def _rms_norm_forward(own):
    """An RMS norm's forward on the kernel for float32 CPU rows; `own` (its class's forward) otherwise."""
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (hidden_states.dtype != torch.float32 or w.dtype != torch.float32 or hidden_states.device.type != "cpu"
                or hidden_states.requires_grad):
            return own(self, hidden_states)
        x = hidden_states.contiguous()
        y = torch.empty_like(x)
        n = x.shape[-1]
        library().specdec_rms_norm(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.numel() // n, n, self.variance_epsilon)
        return y
    return forward


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
               k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor) -> None:
    """In place on qkv [T, heads + 2 kv_heads, d] (contiguous): the rotary embedding of q and k, with
    cos and sin [T, d] (sin's first half negated), and every token's key and value written to the
    pools [kv_heads, slots, d] at `slots` [T] (int64)."""
    tokens, _, d = qkv.shape
    library().specdec_rope_write(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), tokens, heads, kv_heads, d,
                                 k_pool.data_ptr(), v_pool.data_ptr(), k_pool.stride(0), slots.data_ptr())


class Batch:
    """One forward pass's sequences for the kernel: item i has query rows q_start..q_start + n of the
    flattened batch at positions first_pos.., and its keys 0..first_pos + n - 1 at `slots` of the
    pools. Made once per pass, called once per layer."""

    def __init__(self, items: list[tuple[int, int, int, torch.Tensor]]):
        def column(j: int) -> torch.Tensor:
            return torch.tensor([it[j] for it in items], dtype=torch.int64)

        self.q_start, self.n_rows, self.first_pos = column(0), column(1), column(2)
        lengths = [len(it[3]) for it in items]
        self.slot_offset = torch.tensor([0, *lengths[:-1]], dtype=torch.int64).cumsum(0)
        self.slots = torch.cat([it[3].to(torch.int64) for it in items]).contiguous()
        self.lib = library()

    def __call__(self, query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, scale: float) -> torch.Tensor:
        """query [1, heads, T, d]; pools [kv_heads, slots, d] (contiguous) -> [1, T, heads, d]."""
        _, heads, tokens, d = query.shape
        if query.stride(-1) != 1:
            query = query.contiguous()
        out = torch.empty(1, tokens, heads, d, dtype=query.dtype)
        failed = self.lib.specdec_attention(
            query.data_ptr(), query.stride(2), query.stride(1), k_pool.data_ptr(), v_pool.data_ptr(),
            k_pool.stride(0), out.data_ptr(), heads, k_pool.shape[0], d, scale, len(self.q_start),
            self.q_start.data_ptr(), self.n_rows.data_ptr(), self.first_pos.data_ptr(),
            self.slot_offset.data_ptr(), self.slots.data_ptr())
        if failed:
            raise RuntimeError(f"the CPU attention kernel failed ({failed})")
        return out


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface: query [B, heads, T, d], key/value [B, kv_heads, S, d] (the
    cache and the new tokens) -> ([B, T, heads, d], None). One unpadded sequence attending causally
    (the new tokens are the last T of the S positions) runs on the kernel; anything else (padding,
    a custom mask) on SDPA, with a warning: its numbers may then differ from a batch's."""
    batch, _, tokens, _ = query.shape
    length = key.shape[2]
    if batch == 1 and _is_causal(attention_mask, tokens, length) and not dropout:
        k, v = key[0], value[0]
        if not (k.is_contiguous() and v.is_contiguous()):
            k, v = k.contiguous(), v.contiguous()
        run = Batch([(0, tokens, length - tokens, torch.arange(length))])
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return run(query, k, v, scale), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    log.warning("attention with padding or a custom mask runs on SDPA, not the CPU kernel")
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                  **kwargs)


def _is_causal(mask: torch.Tensor | None, tokens: int, length: int) -> bool:
    """The mask (None, or [1, 1, T, S] boolean or additive) lets query row r see exactly keys
    0..S - T + r."""
    if mask is None:
        return True
    if mask.dim() != 4 or mask.shape[0] != 1 or mask.shape[1] != 1 or tuple(mask.shape[2:]) != (tokens, length):
        return False
    allowed = mask if mask.dtype == torch.bool else mask == 0
    causal = torch.ones(tokens, length, dtype=torch.bool).tril(length - tokens)
    return torch.equal(allowed[0, 0].cpu(), causal)
