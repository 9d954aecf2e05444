"""EAGLE-3 draft heads (Li et al., arXiv 2503.01840), in the checkpoint format of vLLM's `speculators`
library, which `vllm serve` loads and in which heads for popular models are published.

A head is one decoder layer beside the target. It reads three of the target's hidden states at a
position t (the residual stream entering the decoder layers `aux_layer_ids`, concatenated, projected
by `fc` to the head's width) and the embedding of the token after it, x_{t+1}, and predicts x_{t+2}
over a small draft vocabulary (`d2t` maps a draft id to its target id: target = draft + d2t[draft]).
A second draft token comes from feeding the head's own output hidden state back with the first
draft token's embedding, and so on:

    step 0:  (fc(g_t), e(x_{t+1}))  at position t+1  ->  h_1, logits for x_{t+2}
    step j:  (h_j, e(x̂_{t+1+j}))    at position t+1+j ->  h_{j+1}, logits for x_{t+2+j}

The layer attends over its own keys: those of every committed pair (g_i, x_{i+1}), i <= t, and those
of the draft steps before it. Training (target_service/train_head.py) unrolls the same steps with
teacher forcing ("training-time test"); `forward_train` builds the matching masks.

The checkpoint (a folder): config.json with `speculators_model_type: "eagle3"`,
`transformer_layer_config` (a Llama decoder layer's config: hidden size, heads, vocab_size = the
target's vocabulary), `draft_vocab_size`, `target_hidden_size`, `eagle_aux_hidden_state_layer_ids`,
`norm_before_residual`, and `speculators_config.verifier.name_or_path`; model.safetensors with
`fc.weight`, `layers.0.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, input_layernorm,
hidden_norm, post_attention_layernorm}.weight`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d` and,
optionally, `embed_tokens.weight` (else the target's embedding is used, as vLLM does).
Supported: one layer, Llama-style, with or without norm_before_residual / norm_output. A file that
asks for more (several layers, norm_before_fc, fc_norm) is refused at load with the field named.

Layer ids follow speculators and transformers' `hidden_states`: id i is the residual stream entering
decoder layer i (id num_layers: the final hidden state, after the final norm).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
EMBEDDED_HEAD = Path(__file__).parent / "heads" / "smollm2"  # trained by `specdec train-head` for the embedded model


class HeadError(ValueError):
    """A head that cannot be loaded, or does not fit the target it is paired with."""


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    norm_before_residual: bool = False
    norm_output: bool = False
    verifier: str | None = None  # the target it was trained for (name or path)
    extra: dict = field(default_factory=dict, compare=False)  # transformer_layer_config's other keys

    @classmethod
    def for_target(cls, target_config, draft_vocab_size: int, aux_layer_ids: list[int] | None = None,
                   verifier: str | None = None) -> HeadConfig:
        """A head as wide as the target (what EAGLE-3 trains), its layer shaped like the target's."""
        n = target_config.num_hidden_layers
        ids = tuple(aux_layer_ids) if aux_layer_ids is not None else (2, n // 2, n - 3) if n > 5 else (0, n // 2, n)
        heads = target_config.num_attention_heads
        return cls(hidden_size=target_config.hidden_size, intermediate_size=target_config.intermediate_size,
                   num_heads=heads, num_kv_heads=getattr(target_config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
                   vocab_size=target_config.vocab_size, draft_vocab_size=min(draft_vocab_size, target_config.vocab_size),
                   target_hidden_size=target_config.hidden_size, aux_layer_ids=ids,
                   rms_norm_eps=target_config.rms_norm_eps, rope_theta=_rope_theta(target_config),
                   max_position_embeddings=target_config.max_position_embeddings, verifier=verifier)

    @classmethod
    def from_json(cls, data: dict) -> HeadConfig:
        if data.get("speculators_model_type") != "eagle3":
            raise HeadError(f"config.json: speculators_model_type is {data.get('speculators_model_type')!r}, "
                            "not 'eagle3' (only EAGLE-3 heads are supported)")
        layer = dict(data.get("transformer_layer_config") or {})
        if not layer:
            raise HeadError("config.json: transformer_layer_config is missing")
        for key, allowed in (("norm_before_fc", False), ("fc_norm", False)):
            if bool(data.get(key, False)) != allowed:
                raise HeadError(f"config.json: {key} = true is not supported")
        if layer.get("num_hidden_layers", 1) != 1:
            raise HeadError(f"config.json: transformer_layer_config.num_hidden_layers = "
                            f"{layer['num_hidden_layers']}; only one-layer heads are supported")
        if layer.get("model_type", "llama") not in ("llama", "qwen2", "mistral"):
            raise HeadError(f"config.json: transformer_layer_config.model_type = {layer['model_type']!r}; "
                            "only Llama-style layers are supported")
        try:
            hidden, heads = int(layer["hidden_size"]), int(layer["num_attention_heads"])
            ids = data.get("eagle_aux_hidden_state_layer_ids")
            verifier = ((data.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
            known = {"hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings", "num_hidden_layers",
                     "model_type"}
            return cls(hidden_size=hidden, intermediate_size=int(layer["intermediate_size"]), num_heads=heads,
                       num_kv_heads=int(layer.get("num_key_value_heads") or heads),
                       head_dim=int(layer.get("head_dim") or hidden // heads), vocab_size=int(layer["vocab_size"]),
                       draft_vocab_size=int(data.get("draft_vocab_size", 32000)),
                       target_hidden_size=int(data.get("target_hidden_size") or hidden),
                       aux_layer_ids=tuple(int(i) for i in ids) if ids else (),
                       rms_norm_eps=float(layer.get("rms_norm_eps", 1e-5)), rope_theta=_rope_theta(layer),
                       max_position_embeddings=int(layer.get("max_position_embeddings", 8192)),
                       norm_before_residual=bool(data.get("norm_before_residual", False)),
                       norm_output=bool(data.get("norm_output", False)), verifier=verifier,
                       extra={k: v for k, v in layer.items() if k not in known})
        except KeyError as e:
            raise HeadError(f"config.json: transformer_layer_config.{e.args[0]} is missing") from None

    def to_json(self, proposal_tokens: int = 4) -> dict:
        """config.json as speculators writes it (its Eagle3SpeculatorConfig)."""
        layer = {**self.extra, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
                 "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                 "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
                 "head_dim": self.head_dim, "vocab_size": self.vocab_size, "num_hidden_layers": 1,
                 "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "hidden_act": "silu",
                 "max_position_embeddings": self.max_position_embeddings, "attention_bias": False,
                 "mlp_bias": False, "tie_word_embeddings": False}
        return {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                "speculators_version": "0.9.0", "transformer_layer_config": layer,
                "draft_vocab_size": self.draft_vocab_size, "norm_before_residual": self.norm_before_residual,
                "norm_before_fc": False, "fc_norm": False, "norm_output": self.norm_output,
                "embed_requires_grad": False, "target_hidden_size": self.target_hidden_size,
                "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                "speculators_config": {
                    "algorithm": "eagle3",
                    "default_proposal_method": "greedy",
                    "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": proposal_tokens}],
                    "verifier": {"name_or_path": self.verifier, "architectures": ["LlamaForCausalLM"]}}}

    def check_target(self, target_config) -> None:
        """Refuse a pairing that cannot work, naming what differs."""
        n = target_config.num_hidden_layers
        problems = []
        if self.target_hidden_size != target_config.hidden_size:
            problems.append(f"target_hidden_size {self.target_hidden_size} != the target's hidden_size "
                            f"{target_config.hidden_size}")
        if self.vocab_size != target_config.vocab_size:
            problems.append(f"vocab_size {self.vocab_size} != the target's {target_config.vocab_size}")
        if len(self.aux_layer_ids) != 3 or any(not 0 <= i <= n for i in self.aux_layer_ids):
            problems.append(f"eagle_aux_hidden_state_layer_ids {list(self.aux_layer_ids)} are not three layer ids "
                            f"of a target with {n} layers")
        if problems:
            raise HeadError("this head does not fit the target: " + "; ".join(problems))


def _rope_theta(config) -> float:
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    params = get("rope_parameters") or get("rope_scaling") or {}
    if isinstance(params, dict) and params.get("rope_type", "default") not in ("default", None):
        raise HeadError(f"rope type {params.get('rope_type')!r} is not supported by the head")
    theta = get("rope_theta") or (params.get("rope_theta") if isinstance(params, dict) else None)
    return float(theta or 10000.0)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype) * self.weight


class _Attention(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.self_attn = _Attention(c)
        self.mlp = _MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


@dataclass
class HeadState:
    """One session's head cache: keys/values [kv_heads, capacity, head_dim] of `length` entries;
    the first `committed` are the pairs (g_i, x_{i+1}) for i = offset, offset + 1, ... (the rest are
    the last proposal's steps). offset > 0: the pairs before it are unknown (a cache the target got
    without computing it, e.g. a shared prefix), and the head attends over the ones it has."""
    keys: torch.Tensor
    values: torch.Tensor
    length: int = 0
    committed: int = 0
    offset: int = 0
    last: torch.Tensor | None = None  # the layer's output at the last committed pair (`Eagle3Head.output`)

    @property
    def num_bytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() * 2


class Eagle3Head(nn.Module):
    def __init__(self, config: HeadConfig, embed_tokens: nn.Embedding | None = None):
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(len(c.aux_layer_ids) * c.target_hidden_size, c.hidden_size, bias=False)
        self.layers = nn.ModuleList([_Layer(c)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        self.embed_tokens = embed_tokens  # the target's (shared, not saved) unless a file brings its own
        # its own parameters (not the target's embedding), counted before any quantization
        self.num_parameters = sum(p.numel() for n, p in self.named_parameters() if not n.startswith("embed_tokens."))
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    # ----------------------------------------------------------------- the layer
    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Llama's rotary embedding (rotate-half) of x [heads, n, head_dim] at positions [n]."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def _qkv(self, hidden: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor):
        """The layer's first half for n inputs: (residual, q [h, n, d], k, v [kv, n, d])."""
        c, layer = self.config, self.layers[0]
        hidden_normed = layer.hidden_norm(hidden)
        residual = hidden_normed if c.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(embeds), hidden_normed], dim=-1)
        n = x.shape[0]
        attn = layer.self_attn
        q = attn.q_proj(x).view(n, c.num_heads, c.head_dim).transpose(0, 1)
        k = attn.k_proj(x).view(n, c.num_kv_heads, c.head_dim).transpose(0, 1)
        v = attn.v_proj(x).view(n, c.num_kv_heads, c.head_dim).transpose(0, 1)
        return residual, self._rope(q, positions), self._rope(k, positions), v

    def _finish(self, residual: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """Attention of q over keys/values (mask [n, m], True = attend), then the MLP: the output hidden."""
        c, layer = self.config, self.layers[0]
        group = c.num_heads // c.num_kv_heads
        if group > 1:
            keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
        out = F.scaled_dot_product_attention(q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                             attn_mask=mask, scale=1 / math.sqrt(c.head_dim))[0]
        hidden = residual + layer.self_attn.o_proj(out.transpose(0, 1).reshape(q.shape[1], -1))
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def _out(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the hidden fed to the next step, draft-vocabulary logits)."""
        normed = self.norm(hidden)
        return (normed if self.config.norm_output else hidden), self.lm_head(normed)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(token_ids)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    # ----------------------------------------------------------------- training
    def forward_train(self, aux: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                      steps: int) -> list[torch.Tensor]:
        """Training-time test over one sequence with teacher forcing (speculators' Eagle3DraftModel):
        aux [n, 3 * target_hidden] (g_i), input_ids [n] (x_{i+1}), positions [n] (i + 1). Step s
        reads the ground-truth token x_{i+1+s} and its own previous output at index i, attends over
        step 0's keys causally and over steps 1..s's keys at index i only. Returns each step's
        logits [n, draft_vocab]; step s's row i predicts x_{i+2+s} (rows past the end are padding)."""
        n = aux.shape[0]
        hidden = self.fc(aux)
        causal = torch.ones(n, n, dtype=torch.bool, device=aux.device).tril()
        diagonal = torch.eye(n, dtype=torch.bool, device=aux.device)
        keys, values, logits = [], [], []
        ids = input_ids
        for s in range(steps):
            residual, q, k, v = self._qkv(hidden, self.embed(ids), positions + s)
            keys.append(k)
            values.append(v)
            mask = torch.cat([causal] + [diagonal] * s, dim=1)
            out = self._finish(residual, q, torch.cat(keys, 1), torch.cat(values, 1), mask)
            hidden, step_logits = self._out(out)
            logits.append(step_logits)
            ids = torch.cat([input_ids[1 + s:], input_ids.new_zeros(1 + s)])
        return logits

    # ----------------------------------------------------------------- serving
    def new_state(self, capacity: int, dtype: torch.dtype | None = None) -> HeadState:
        c = self.config
        dtype = dtype or self.norm.weight.dtype
        shape = (c.num_kv_heads, capacity, c.head_dim)
        return HeadState(torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype))

    @torch.no_grad()
    def extend(self, state: HeadState, aux: torch.Tensor, next_ids: torch.Tensor) -> None:
        """Add committed pairs (g_i, x_{i+1}) for the next len(next_ids) positions, dropping the last
        proposal's steps first; keeps the layer's output at the last one (the first draft's source,
        `output`)."""
        n = aux.shape[0]
        if n == 0:
            return
        start = state.length = state.committed
        self._grow(state, start + n)
        positions = torch.arange(state.offset + start + 1, state.offset + start + n + 1)
        residual, q, k, v = self._qkv(self.fc(aux.to(self.norm.weight.dtype)), self.embed(next_ids), positions)
        state.keys[:, start:start + n] = k
        state.values[:, start:start + n] = v
        mask = torch.ones(n, start + n, dtype=torch.bool).tril(start)
        out = self._finish(residual, q, state.keys[:, :start + n], state.values[:, :start + n], mask)
        state.length = state.committed = start + n
        state.last = out[-1:]

    def output(self, state: HeadState) -> tuple[torch.Tensor, torch.Tensor]:
        """(the hidden state fed to the first draft step, its draft-vocabulary logits) at the last
        committed pair."""
        return self._out(state.last)

    @torch.no_grad()
    def step(self, state: HeadState, hidden: torch.Tensor, token_id: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step after the committed pairs and the steps before it: (hidden, logits)."""
        at = state.length
        self._grow(state, at + 1)
        residual, q, k, v = self._qkv(hidden, self.embed(token_id.view(1)), torch.tensor([state.offset + at + 1]))
        state.keys[:, at:at + 1] = k
        state.values[:, at:at + 1] = v
        out = self._finish(residual, q, state.keys[:, :at + 1], state.values[:, :at + 1], None)
        state.length = at + 1
        return self._out(out)

    def for_cpu(self) -> Eagle3Head:
        """A copy whose linear layers run in int8 (PyTorch's dynamic quantization: int8 weights,
        inputs quantized per call). A head step on a CPU reads its weights once per token, so it is
        bound by memory: int8 takes SmolLM2's head from 2.4 to 0.43 ms a step here. Its proposals
        are drafts like any other: the target's verdict keeps the output exact."""
        import copy
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantized = torch.ao.quantization.quantize_dynamic(copy.deepcopy(self), {nn.Linear}, dtype=torch.qint8)
        quantized.embed_tokens = self.embed_tokens  # the target's, shared (deepcopy made its own)
        return quantized

    def rollback(self, state: HeadState, committed: int) -> None:
        """Forget pairs past `committed` (a session cut back)."""
        state.committed = min(state.committed, committed)
        state.length = state.committed
        state.last = None

    @staticmethod
    def _grow(state: HeadState, needed: int) -> None:
        capacity = state.keys.shape[1]
        if needed <= capacity:
            return
        size = max(needed, 2 * capacity, 64)
        for name in ("keys", "values"):
            old = getattr(state, name)
            new = old.new_empty((old.shape[0], size, old.shape[2]))
            new[:, :state.length] = old[:, :state.length]
            setattr(state, name, new)


# --------------------------------------------------------------------- files
def save_head(head: Eagle3Head, folder: str | Path, proposal_tokens: int = 4, dtype: torch.dtype | None = None,
              include_embeddings: bool = False) -> Path:
    """Write the head in the speculators format (config.json, model.safetensors)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v for k, v in head.state_dict().items() if include_embeddings or not k.startswith("embed_tokens.")}
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / WEIGHTS_FILE),
              metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(head.config.to_json(proposal_tokens), indent=2) + "\n")
    return folder


def resolve_head(ref: str) -> Path:
    """A local folder, or a hub id fetched the way the target's model is (huggingface_hub's cache)."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return path
    if path.exists() or ref.startswith((".", "/", "~")):
        raise HeadError(f"--head {ref}: not a folder")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(ref, allow_patterns=[CONFIG_FILE, "*.safetensors"]))
    except Exception as e:  # offline, unknown id, ...
        raise HeadError(f"--head {ref}: not a local folder and not loadable from the hub ({e})") from None


def load_head(ref: str, target, dtype: torch.dtype = torch.float32) -> Eagle3Head:
    """A head from a speculators EAGLE-3 folder (or hub id), checked against `target` (a transformers
    causal LM: its config, and its embedding when the file has none)."""
    from safetensors.torch import load_file

    folder = resolve_head(ref)
    try:
        config = HeadConfig.from_json(json.loads((folder / CONFIG_FILE).read_text()))
    except (OSError, json.JSONDecodeError) as e:
        raise HeadError(f"{folder / CONFIG_FILE}: {e}") from None
    target_config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    config.check_target(target_config)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise HeadError(f"{folder}: no .safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    embed = weights.pop("embed_tokens.weight", None)
    if embed is None:
        if config.hidden_size != target_config.hidden_size:
            raise HeadError("the head has no embed_tokens.weight and its hidden_size differs from the target's")
        embedding = target.get_input_embeddings()
    else:
        embedding = nn.Embedding.from_pretrained(embed.to(dtype), freeze=True)
    for name in [k for k in weights if k.startswith("verifier_")]:
        del weights[name]
    head = Eagle3Head(config, embedding)
    if "t2d" not in weights and "d2t" not in weights and config.draft_vocab_size == config.vocab_size:
        weights["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
        weights["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
    own = {k: v for k, v in head.state_dict().items() if not k.startswith("embed_tokens.")}
    missing = sorted(set(own) - set(weights))
    unexpected = sorted(set(weights) - set(own))
    if missing or unexpected:
        raise HeadError(f"{folder}: weights do not match an EAGLE-3 head of this config "
                        f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    for k, v in weights.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise HeadError(f"{folder}: {k} has shape {tuple(v.shape)}, the config says {tuple(own[k].shape)}")
    head.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()},
                         strict=False)
    targets = head.to_target(torch.arange(config.draft_vocab_size))
    if int(targets.min()) < 0 or int(targets.max()) >= config.vocab_size:
        raise HeadError(f"{folder}: d2t maps draft ids outside the target's vocabulary")
    return head.to(dtype).eval()
