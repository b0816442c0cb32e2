"""Cost tables of the shapes measured on real machines, for tests of the planner on no machine in particular."""

from ggufspec.costs import Costs


def cpu_like(exact_batch=3):
    # Measured shape of this machine: a batch of k costs nearly k steps; the draft costs 0.6 of a step.
    return Costs([0.043, 0.070, 0.093, 0.130, 0.150, 0.171, 0.19, 0.28, 0.29], exact_batch, 0.025)


def gpu_like():
    # A verify batch is almost free; the draft is cheap.
    return Costs([0.040, 0.041, 0.042, 0.043, 0.044, 0.045, 0.046, 0.047, 0.048], 1, 0.006)


def cpu_q8_like():
    # The shape measured on an AVX2 EPYC for a Q8_0 target: kernels take rows 4 at a time, so odd batches
    # cost more than the even one above them; every batch up to 16 is exact.
    steps = [1.0, 1.40, 2.45, 1.95, 2.99, 2.64, 3.45, 3.55, 4.25, 3.59, 4.69, 4.47, 6.08, 5.06, 5.92, 5.48]
    return Costs([0.09 * s for s in steps], 16, 0.021)


def cpu_q8_zen3_like():
    # The default pair on a 2-vCPU AMD EPYC Zen 3 (AVX2), 2026-12-07: a Q8_0 target whose batches are exact to 16 (5 rows
    # 2.94 steps, 6 rows 2.48), and a Q4_0 draft at 0.23 of a step: a draft right 80% of the time (auto's prior) loses
    # here, one right 92% of the time (on code) pays.
    steps = [1.0, 1.6, 2.29, 2.19, 2.94, 2.48, 3.75, 3.46, 4.39, 4.03, 5.18, 4.96, 6.18, 6.0, 6.95, 6.25]
    return Costs([0.0746 * s for s in steps], 16, 0.0173, exact_kv=256, draft_round_seconds=0.007)


def _to_64(step: float, steps: list[float], long_steps: dict[int, float]) -> list[float]:
    """A table as `measure` keeps one: sizes 1-16 each timed, those beyond at the sizes long_steps holds (a size between
    takes the next timed one's time)."""
    out = [step * s for s in steps]
    for n in range(17, 65):
        out.append(step * long_steps[min(k for k in long_steps if k >= n)])
    return out


def cpu_q4km_like(exact_kv=None):
    # A Q4_K_M target on a 2-vCPU AVX-512 Xeon: repacked Q4_K kernels take rows four at a time (a batch of 4 costs
    # less than one of 3, and only batches up to 3 are exact), and a batch of 48 costs under 12 steps.
    steps = [1.0, 1.58, 2.19, 1.89, 2.65, 3.27, 3.71, 4.14, 4.54, 5.1, 5.36, 4.93, 5.46, 6.57, 6.43, 4.88]
    return Costs(_to_64(0.077, steps, {24: 7.47, 32: 7.98, 48: 11.76, 64: 14.94}), 3, 0.037, exact_kv=exact_kv)


def cpu_q4km_zen3_like(exact_kv=256):
    # The Q4_K_M target on a 2-vCPU AMD EPYC Zen 3 (AVX2): exact up to 3 up to 256 cached tokens, a batch of 16 at
    # 6.48 steps, one of 64 at 23.38 (2.74 tokens a step against 2.47).
    steps = [1.0, 1.55, 2.06, 2.3, 2.62, 3.35, 4.02, 6.28, 6.64, 6.57, 8.99, 7.36, 9.2, 7.23, 7.4, 6.48]
    return Costs(_to_64(0.088, steps, {24: 9.82, 32: 12.79, 48: 19.27, 64: 23.38}), 3, 0.03, exact_kv=exact_kv)


def cpu_q4km_zen3_dear_like(exact_kv=256):
    # The same target on the same kind of Zen 3 host another day (`ggufspec costs qwen2.5-coder-1.5b`, 2026-12-07):
    # batches dearer beyond 3 rows (4 rows 3.16 steps, 16 rows 8.63, 48 rows 19.96), so a copy that the estimates
    # doubt goes two tokens at a time.
    steps = [1.0, 1.63, 2.13, 3.16, 3.59, 4.67, 4.75, 7.26, 7.04, 7.36, 7.66, 10.68, 10.15, 8.9, 10.42, 8.63]
    return Costs(_to_64(0.0521, steps, {24: 14.11, 32: 14.46, 48: 19.96, 64: 29.48}), 3, 0.0222, exact_kv=exact_kv)


def cpu_q8_long_like(exact_kv=None):
    # The Q8_0 build of the same target on the same Xeon: every batch up to 16 exact, and 16 rows cost less per row
    # than 48 (4.14 steps against 12.72).
    steps = [1.0, 1.25, 1.45, 1.74, 2.76, 3.02, 3.31, 3.12, 4.08, 4.3, 4.56, 4.54, 5.27, 3.85, 4.02, 4.14]
    return Costs(_to_64(0.141, steps, {24: 6.2, 32: 8.38, 48: 12.72, 64: 22.24}), 16, 0.044, exact_kv=exact_kv)
