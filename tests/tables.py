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
