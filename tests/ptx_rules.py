"""Reading a Triton kernel's PTX for the programmatic-dependent-launch rule (kernels/launch_pdl.py): before its
``griddepcontrol.wait`` a kernel writes nothing and reads only what its allowed (weight) arguments point to, the wait
is reached on every path (no branch before it, not predicated), and ``launch_dependents`` comes after it.

PTX from Triton's LLVM backend is straight-line before the wait in our kernels, with each register defined once
there, so the address of every memory instruction can be traced back through its defining instructions to the
``ld.param`` of the kernel arguments it derives from."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_OPERANDS = re.compile(r"%[\w.]+|\b\w+_param_\d+\b")
_ADDRESS = re.compile(r"\[\s*(%\w+)")
_PARAM = re.compile(r"_param_(\d+)\b")


@dataclass
class PreWait:
    """What a kernel does before its wait."""
    read_params: set[int] = field(default_factory=set)  # kernel parameters whose memory it reads there
    writes: list[str] = field(default_factory=list)  # memory writes there (the rule allows none)
    problems: list[str] = field(default_factory=list)  # anything else against the rule


def _instructions(ptx: str) -> list[str]:
    out = []
    for line in ptx.splitlines():
        line = line.split("//")[0].strip()
        if not line or line.startswith((".", "$", "{", "}")) or line.endswith(":"):
            continue
        out.append(line.rstrip(";").strip())
    return out


def _opcode(instr: str) -> str:
    parts = instr.split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0] if parts else ""


def _is_read(op: str) -> bool:
    if op.startswith("ld."):
        return not op.startswith(("ld.param", "ld.shared", "ld.local", "ld.const"))
    return op.startswith(("cp.async", "prefetch"))


def _is_write(op: str) -> bool:
    if op.startswith("st."):
        return not op.startswith(("st.shared", "st.local", "st.param"))
    return op.startswith(("atom", "red.", "cp.reduce"))


def pre_wait(ptx: str) -> PreWait:
    report = PreWait()
    instrs = _instructions(ptx)
    waits = [i for i, s in enumerate(instrs) if _opcode(s) == "griddepcontrol.wait"]
    if not waits:
        report.problems.append("no griddepcontrol.wait")
        return report
    at = waits[0]
    if instrs[at].startswith("@"):
        report.problems.append(f"the wait is predicated: {instrs[at]}")
    releases = [i for i, s in enumerate(instrs) if _opcode(s) == "griddepcontrol.launch_dependents"]
    if releases and releases[0] < at:
        report.problems.append("launch_dependents before the wait")
    defs: dict[str, list[str]] = {}  # register -> the registers and parameters its definition reads
    for instr in instrs[:at]:
        op = _opcode(instr)
        if op.startswith(("bra", "ret", "exit", "brx")):
            report.problems.append(f"control flow before the wait: {instr}")
        body = instr[instr.index(op) + len(op):]
        if _is_write(op):
            report.writes.append(instr)
            continue
        if body.strip().startswith("{"):  # vector destination: { %r1, %r2 }, [...]
            dests_text, _, rest = body.partition("}")
            dests = _OPERANDS.findall(dests_text)
        else:
            first, _, rest = body.partition(",")
            dests = _OPERANDS.findall(first)
        sources = _OPERANDS.findall(rest)
        for d in dests:
            defs[d] = sources
        if _is_read(op):
            address = _ADDRESS.search(rest)
            if address is None:
                report.problems.append(f"a read with no register address: {instr}")
                continue
            report.read_params |= _params_of(address.group(1), defs)
    return report


def _params_of(reg: str, defs: dict[str, list[str]]) -> set[int]:
    params, seen, todo = set(), set(), [reg]
    while todo:
        r = todo.pop()
        if r in seen:
            continue
        seen.add(r)
        for s in defs.get(r, ()):
            m = _PARAM.search(s)
            if m and not s.startswith("%"):
                params.add(int(m.group(1)))
            else:
                todo.append(s)
    return params
