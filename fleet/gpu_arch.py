"""Can an env's torch run kernels on these GPUs? Its build's architectures against the GPUs' compute
capabilities (pure).

A torch wheel carries machine code (cubins, ``sm_XY``) for a list of architectures and sometimes
PTX (``compute_XY``) that the driver compiles at load time; ``torch.cuda.get_arch_list()`` names
them (recorded in the env's manifest at build time, no GPU needed). A GPU whose compute
capability none of them serves fails only at its first kernel ("no kernel image is available for
execution on the device"), after the deploy, the warm-up and the target's load. The rules are
CUDA's (CUDA C++ Programming Guide, "Binary Compatibility" and "PTX Compatibility"):

- a cubin for ``sm_XY`` runs on a GPU of compute capability X.Z with Z >= Y (same major only);
- an architecture-specific cubin (``sm_90a``, ``sm_120a``) runs on X.Y alone; a family-specific
  one (``sm_100f``, CUDA 12.9+) on the same major with Z >= Y;
- PTX for ``compute_XY`` is JIT-compiled for any GPU of compute capability >= X.Y
  (``compute_XYa``: X.Y alone).

torch's own start-up warning (``torch/cuda/__init__.py``, ``_check_cubins``) applies the same
major-version rule to the ``sm_`` entries only; the tests check both agree on real builds.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

# `nvidia-smi --query-gpu=<CAPS_FIELDS> --format=csv`: `compute_cap` exists since driver 510
CAPS_FIELDS = ("index", "name", "compute_cap")
ARCH_RE = re.compile(r"^(sm|compute)_(\d+)(\d)([af]?)$")
CAP_RE = re.compile(r"^(\d+)\.(\d+)$")
# What to lock for a GPU generation (envs/README.md, "GPU architectures")
BUILD_ADVICE = {
    major: f"a torch built with sm_{major}0 (torch >= 2.7 for CUDA 12.8 or newer: the PyTorch index's "
    "cu128 / cu130 wheels, or PyPI's torch 2.11 (cu130) as envs/train locks it; driver >= 570 for CUDA 12.8, "
    ">= 580 for 13.0)"
    for major in (10, 12)
}
DEFAULT_ADVICE = "a torch whose CUDA build lists that architecture (torch.cuda.get_arch_list())"


@dataclass(frozen=True)
class Arch:
    """One entry of ``torch.cuda.get_arch_list()``: ``sm_90``, ``sm_90a``, ``compute_120``."""

    ptx: bool
    major: int
    minor: int
    variant: str  # "" | "a" (architecture-specific) | "f" (family-specific)

    def runs_on(self, cap: tuple[int, int]) -> bool:
        if self.variant == "a":
            return cap == (self.major, self.minor)
        if self.ptx:
            return cap >= (self.major, self.minor)
        return cap[0] == self.major and cap[1] >= self.minor


def parse_arch(name: str) -> Arch | None:
    m = ARCH_RE.match(name.strip())
    if not m:
        return None
    return Arch(m.group(1) == "compute", int(m.group(2)), int(m.group(3)), m.group(4))


def sm(cap: tuple[int, int]) -> str:
    return f"sm_{cap[0]}{cap[1]}"


@dataclass(frozen=True)
class GpuCap:
    """One GPU's compute capability, as ``nvidia-smi --query-gpu=index,name,compute_cap`` prints it."""

    index: int
    name: str
    cap: tuple[int, int]


def parse_caps(text: str) -> tuple[GpuCap, ...]:
    """``nvidia-smi --query-gpu=index,name,compute_cap --format=csv``; rows without a readable
    capability (``[N/A]``) are left out. ValueError when the header is not the query's."""
    lines = [line for line in text.splitlines() if line.strip()]
    header = [h.strip() for h in lines[0].split(",")] if lines else []
    if header != list(CAPS_FIELDS):
        raise ValueError(f"not a compute_cap query's output: {(lines or [''])[0][:120]!r}")
    gpus = []
    for line in lines[1:]:
        cells = [c.strip() for c in line.rsplit(",", 1)]  # the name may hold a comma: split the ends
        first = cells[0].split(",", 1)
        if len(cells) != 2 or len(first) != 2 or not first[0].strip().isdigit():
            continue
        m = CAP_RE.match(cells[1])
        if m:
            gpus.append(GpuCap(int(first[0]), first[1].strip(), (int(m.group(1)), int(m.group(2)))))
    return tuple(gpus)


def _archs(arch_list: Sequence[str], ptx: bool | None = None) -> list[Arch]:
    found = [a for a in (parse_arch(n) for n in arch_list) if a is not None]
    return [a for a in found if ptx is None or a.ptx == ptx]


def unserved(arch_list: Sequence[str], gpus: Sequence[GpuCap]) -> tuple[GpuCap, ...]:
    """The GPUs no entry of ``arch_list`` (cubin or PTX) runs on."""
    archs = _archs(arch_list)
    return tuple(g for g in gpus if not any(a.runs_on(g.cap) for a in archs))


def jit_only(arch_list: Sequence[str], gpus: Sequence[GpuCap]) -> tuple[GpuCap, ...]:
    """The GPUs served by PTX alone: every kernel is JIT-compiled by the driver at first use."""
    cubins = _archs(arch_list, ptx=False)
    served = set(unserved(arch_list, gpus))
    return tuple(g for g in gpus if g not in served and not any(a.runs_on(g.cap) for a in cubins))


def arch_mismatch(env: str, torch: str, arch_list: Sequence[str], gpus: Sequence[GpuCap]) -> str:
    """One line: why ``env``'s torch has no kernel for these GPUs, and the fix; "" when it has."""
    missing = unserved(arch_list, gpus)
    if not missing or not arch_list:
        return ""
    caps = sorted({g.cap for g in missing})
    which = "; ".join(
        f"GPU {', '.join(str(g.index) for g in missing if g.cap == cap)} "
        f"{next(g.name for g in missing if g.cap == cap)} (compute capability {cap[0]}.{cap[1]}, {sm(cap)})"
        for cap in caps
    )
    has_ptx = any(name.startswith("compute_") for name in arch_list)
    ptx = "" if has_ptx else ", no PTX"
    advice = BUILD_ADVICE.get(caps[-1][0], DEFAULT_ADVICE)
    return (
        f"env {env}'s torch {torch} has kernels for {' '.join(arch_list)}{ptx}, none for {which}: "
        f"its first kernel would fail (no kernel image for the device); lock {advice} in envs/{env} "
        '(envs/README.md, "GPU architectures"), then `fab env-rebuild`'
    )
