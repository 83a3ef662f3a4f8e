"""Counting a program's Pallas kernel calls in its jaxpr."""


def pallas_calls(jaxpr) -> int:
    """The pallas_call equations of a (closed) jaxpr, those inside the functions and loops it calls
    included: each launches one kernel per call. The kernel entry points are jitted, so a kernel
    call sits inside a nested function's jaxpr, written out once however often it is called; this
    counts it at every call."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            total += 1
            continue
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                if hasattr(inner, "eqns") or hasattr(getattr(inner, "jaxpr", None), "eqns"):
                    total += pallas_calls(inner)
    return total
