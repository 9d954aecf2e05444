"""How the engine runs on this machine: which of our CPU kernels it uses, and where it caches the
kernels it compiles and the GGUF models it converts. A worker builds it once in main() from flags
whose defaults come from the environment (`add_flags`, `from_env`) and passes it down; the engine
reads no environment variable itself."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


def default_cache_dir(env: Mapping[str, str]) -> Path:
    """$SPECDEC_CACHE_DIR, else $XDG_CACHE_HOME/specdec, else ~/.cache/specdec."""
    root = env.get("SPECDEC_CACHE_DIR") or os.path.join(
        env.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "specdec")
    return Path(root)


@dataclass(frozen=True)
class EngineOptions:
    cache_dir: Path  # compiled kernels (kernels/) and GGUF models converted to safetensors (converted/)
    cpu_attention: bool = True  # our C kernels (attention, RMS norm, rotary; the quantized linears' too)
    packed_linears: bool = True  # CPU linears on oneDNN with packed weights (cpu_linear)
    quantized_linears: bool = True  # CPU linears from their block-quantized codes (cpu_quantized)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> EngineOptions:
        """The options a deployment sets through the environment: SPECDEC_CACHE_DIR, and
        SPECDEC_CPU_ATTENTION, SPECDEC_PACKED_LINEARS, SPECDEC_QUANTIZED_LINEARS (0: off)."""
        env = os.environ if env is None else env
        def on(name: str) -> bool:
            return env.get(name, "1") != "0"
        return cls(default_cache_dir(env), on("SPECDEC_CPU_ATTENTION"), on("SPECDEC_PACKED_LINEARS"),
                   on("SPECDEC_QUANTIZED_LINEARS"))

    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser) -> None:
        d = cls.from_env()
        g = parser.add_argument_group("engine: CPU kernels and caches")
        g.add_argument("--cache-dir", type=Path, default=d.cache_dir,
                       help="where compiled CPU kernels and GGUF models converted to safetensors are kept "
                            "(env SPECDEC_CACHE_DIR; default $XDG_CACHE_HOME/specdec or ~/.cache/specdec)")
        g.add_argument("--cpu-attention", action=argparse.BooleanOptionalAction, default=d.cpu_attention,
                       help="CPU float32 attention, RMS norms and rotary embedding on our C kernels, compiled "
                            "with cc at first start; off keeps PyTorch's and turns the block-quantized linears off "
                            "too, since they run on the same library (env SPECDEC_CPU_ATTENTION=0)")
        g.add_argument("--packed-linears", action=argparse.BooleanOptionalAction, default=d.packed_linears,
                       help="CPU linear layers on oneDNN with weights packed at load; off keeps PyTorch's own "
                            "(env SPECDEC_PACKED_LINEARS=0)")
        g.add_argument("--quantized-linears", action=argparse.BooleanOptionalAction, default=d.quantized_linears,
                       help="CPU linear layers whose float32 weights are exactly GGUF Q4_1 / Q8_0 values run from "
                            "their codes (AVX-512); off keeps oneDNN (env SPECDEC_QUANTIZED_LINEARS=0)")

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> EngineOptions:
        return cls(a.cache_dir, a.cpu_attention, a.packed_linears, a.quantized_linears)
