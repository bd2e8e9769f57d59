"""Hand-written compute kernels."""

from quickdraft.kernels.cpu_linear import kernel_available, skinny_linear

__all__ = ["build_cpu_kernels", "kernel_available", "skinny_linear"]


def build_cpu_kernels(*, threads: int = 1) -> list[str]:
    """Build (or load the cached builds of) every C++ kernel now, rather than when a request first
    needs one: a first build takes ~35 s per kernel on a 2-core machine. Servers run it beside the
    engine loop at start. Returns the names of the kernels that do not run here (their callers
    use torch code). `threads` builds that many at once (each build is one compiler process)."""
    from concurrent.futures import ThreadPoolExecutor

    from quickdraft.kernels import argmax, attention, cpu_linear, draft_mixture, keyed_draw, quant_linear, token_mask

    checks = {
        "quant_linear": quant_linear.kernel_available,
        "attention": attention.kernel_available,
        "argmax": argmax.kernel_available,
        "keyed_draw": keyed_draw.kernel_available,
        "token_mask": token_mask.kernel_available,
        "draft_mixture": draft_mixture.available,
        "skinny_linear": cpu_linear.kernel_available,
    }
    if threads == 1:  # in the caller's thread (a server's daemon thread: its exit waits for no build)
        return [name for name, available in checks.items() if not available()]
    # A pool's threads are joined at interpreter exit, which then waits for every queued build.
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kernel-build") as pool:
        results = dict(zip(checks, pool.map(lambda available: available(), checks.values())))
    return [name for name, available in results.items() if not available]
