"""A Llama-family model's forward pass over a `BatchedBackend` batch, without transformers' module
machinery: the same tensor operations, in the same order, on the same weights, so the logits are
bit for bit those of `model(...)` (checked at the first batch, see `BatchedBackend._run`).

Why: a decode step of SmolLM2-135M on this project's 2-core CPU spent ~4.5 ms of its 40-53 ms in
Python around the operations (module calls, their decorators and keyword plumbing, the causal-mask
builder whose mask the batch ignores), not in them: 1 session 40.4 -> 36.5 ms, 8 sessions
52.7 -> 48.2 ms per pass (`benchmarks/engine_step.py`, 200-token contexts).

Per layer, as `LlamaDecoderLayer` does it:
    x = rmsnorm(h);  q, k, v = rope(q_proj x), rope(k_proj x), v_proj x
    h = h + o_proj(attention(q, k, v))          (the batch's per-session attention)
    h = h + down_proj(act(gate_proj x') * up_proj x'),   x' = rmsnorm(h)
then the final norm and the LM head on the kept rows.

Only models whose layers are exactly this shape qualify (`LeanPass.of`): any other submodule
(a q/k norm, a sliding window, a scaled embedding) or any module hook (tensor parallelism wraps
the linears in hooks) leaves the model on its own forward.
"""

from __future__ import annotations

import torch

from specdec_core.engine.cpu_kernels import is_rms_norm
from specdec_core.engine.cpu_linear import Fused

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj", "act_fn")
_LAYER = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}


class LeanPass:
    """`__call__(input_ids [1, T], position_ids [1, T], view, rows [R]) -> logits [R, V]`.

    With packed CPU linears (`cpu_linear`), each layer's projections that read the same input run as
    one (`cpu_linear.Fused`: q/k/v, gate/up) and the residual adds ride in the output projections'
    calls; `share()` (once the first batch agreed) lets the model's own layers use the fused weights,
    so fusing costs no memory. Rotary embedding runs on q and k together, token-major: rotate_half(x)
    * sin is roll(x, d/2) * sin with the first half of sin negated (a sign flip, exact). Where the
    CPU kernels serve the batch (`cpu_kernels`), the rotary embedding and the pool writes are one
    call of theirs (the same bits as PyTorch's operations), and the norms are the model's own forward
    (the kernel's, when `cpu_kernels.enable` swapped it in)."""

    def __init__(self, model):
        self.model = model
        self.decoder = model.model
        self.layers = list(self.decoder.layers[: model.config.num_hidden_layers])
        self.fused = _fused_layers(model, self.layers)

    @classmethod
    def of(cls, model) -> LeanPass | None:
        """A lean pass for this model, or None when its layers are not plain Llama layers."""
        decoder = getattr(model, "model", None)
        if decoder is None or not hasattr(model, "lm_head") or any(
                not hasattr(decoder, name) for name in ("embed_tokens", "rotary_emb", "layers", "norm")):
            return None
        if type(decoder.embed_tokens) is not torch.nn.Embedding or not is_rms_norm(decoder.norm):
            return None
        if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
            return None
        if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
            return None
        for layer in decoder.layers:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if {name for name, _ in layer.named_children()} != _LAYER:
                return None
            if {name for name, _ in attn.named_children()} != set(_ATTENTION):
                return None
            if {name for name, _ in mlp.named_children()} != set(_MLP):
                return None
            if not (is_rms_norm(layer.input_layernorm) and is_rms_norm(layer.post_attention_layernorm)):
                return None
            if not all(isinstance(getattr(attn, n), torch.nn.Linear) for n in _ATTENTION):
                return None
            if not all(isinstance(getattr(mlp, n), torch.nn.Linear) for n in _MLP[:3]):
                return None
        return cls(model)

    def share(self) -> None:
        """The lean pass agreed with the model: its layers may compute from the fused weights."""
        for f in self.fused or ():
            f.qkv.share()
            f.gate_up.share()

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, view, rows: torch.Tensor,
                 capture: tuple[int, ...] = (), captured: list | None = None) -> torch.Tensor:
        """capture: layer ids whose input (the residual stream entering them; id num_layers: the
        model's final hidden state, after the final norm, as transformers' hidden_states has it) is
        appended to `captured`, [T, hidden] each, in the order of `capture` (what an EAGLE-3 head reads)."""
        h = self.decoder.embed_tokens(input_ids)  # [1, T, hidden]
        layer_inputs: dict[int, torch.Tensor] = {}
        cos, sin = self.decoder.rotary_emb(h, position_ids=position_ids)  # [1, T, head_dim]
        half = sin.shape[-1] // 2
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        # the kernel's rotary embedding and pool writes in one call (view.kernel: the CPU kernels serve)
        flat = (cos[0].contiguous(), sin[0].contiguous()) if view.kernel is not None and self.fused else None
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [1, T, 1, head_dim]: token-major, over heads
        tokens = h.shape[1]
        for i, layer in enumerate(self.layers):
            if i in capture:
                layer_inputs[i] = h[0].clone()
            attn, mlp = layer.self_attn, layer.mlp
            d, f = attn.head_dim, self.fused[i] if self.fused else None
            x = layer.input_layernorm.forward(h)
            if flat is not None and flat[0].shape[-1] == d:
                qkv = f.qkv(x).view(tokens, -1, d)  # [T, heads + 2 kv_heads, d]
                q = view.write_qkv(attn.layer_idx, qkv, *flat, f.heads, f.kv_heads)
                o = view.attend(attn.layer_idx, q, None, None, attn.scaling).reshape(1, tokens, -1)
            else:
                o = self._attention(view, attn, f, x, cos, sin, half)
            if f is not None:
                h = f.o.add(o, h)
                x = layer.post_attention_layernorm.forward(h)
                gate, up = f.gate_up(x).split(f.intermediate, dim=-1)
                h = f.down.add(mlp.act_fn(gate) * up, h)
            else:
                h = h + attn.o_proj.forward(o.contiguous())
                x = layer.post_attention_layernorm.forward(h)
                h = h + mlp.down_proj.forward(mlp.act_fn(mlp.gate_proj.forward(x)) * mlp.up_proj.forward(x))
        h = self.decoder.norm.forward(h)
        if capture:
            layer_inputs[len(self.layers)] = h[0]
            captured.extend(layer_inputs[i] for i in capture)
        return self.model.lm_head.forward(h[:, rows, :])[0]

    @staticmethod
    def _attention(view, attn, f: _FusedLayer | None, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   half: int) -> torch.Tensor:
        """The layer's attention with PyTorch's operations: q/k/v, rotary, pool writes -> [1, T, heads d]."""
        tokens, d = x.shape[1], attn.head_dim
        if f is not None:
            qkv = f.qkv(x).view(1, tokens, -1, d)  # [1, T, heads + 2 kv_heads, d]
            heads, kv = f.heads, f.kv_heads
            qk = _rope(qkv[:, :, :heads + kv], cos, sin, half)
            q, k, v = qk[:, :, :heads], qk[:, :, heads:], qkv[:, :, heads + kv:]
        else:
            q = _rope(attn.q_proj.forward(x).view(1, tokens, -1, d), cos, sin, half)
            k = _rope(attn.k_proj.forward(x).view(1, tokens, -1, d), cos, sin, half)
            v = attn.v_proj.forward(x).view(1, tokens, -1, d)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [1, heads, T, d]
        view.update(k, v, attn.layer_idx)
        return view.attend(attn.layer_idx, q, k, v, attn.scaling).reshape(1, tokens, -1)  # [1, T, heads d]


class _FusedLayer:
    """One layer's projections as fused packed linears."""

    def __init__(self, layer):
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = Fused(attn.q_proj, attn.k_proj, attn.v_proj)
        self.o = Fused(attn.o_proj)
        self.gate_up = Fused(mlp.gate_proj, mlp.up_proj)
        self.down = Fused(mlp.down_proj)
        self.heads = attn.q_proj.out_features // attn.head_dim
        self.kv_heads = attn.k_proj.out_features // attn.head_dim
        self.intermediate = mlp.gate_proj.out_features


def _fused_layers(model, layers) -> list[_FusedLayer] | None:
    """The layers' fused projections when every linear is packed, made once per model (a second
    backend over the same model shares them)."""
    fused = model.__dict__.get("_specdec_fused_layers")
    if fused is None:
        linears = [m for layer in layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
        if not linears or not all(hasattr(m, "specdec_packed_weight") for m in linears):
            return None
        fused = [_FusedLayer(layer) for layer in layers]
        model.__dict__["_specdec_fused_layers"] = fused
    return fused


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with sin's first half negated by the caller: [1, T, heads, d]."""
    return x * cos + x.roll(half, dims=-1) * sin
