"""Counting a program's Pallas kernel calls in its jaxpr."""


def pallas_calls(jaxpr) -> int:
    """The pallas_call equations of a (closed) jaxpr, those inside the functions and loops it calls
    included: each launches one kernel per call. The kernel entry points are jitted, so a kernel
    call sits inside a nested function's jaxpr, written out once however often it is called; this
    counts it at every call."""
    return len(pallas_names(jaxpr))


def pallas_names(jaxpr) -> list[str]:
    """The kernel names of `pallas_calls`'s equations, in program order, one per call."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    names = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            names.append(str(eqn.params["name"]))
            continue
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                if hasattr(inner, "eqns") or hasattr(getattr(inner, "jaxpr", None), "eqns"):
                    names += pallas_names(inner)
    return names
