"""Extension projects: what the reference does not have, built by the student and wired in here.

The adapter pattern of Stanford CS336: each function below returns None until you make it call your
code (import your module inside it and return its result). tests/course/test_extensions.py skips an
extension's tests while its adapter returns None, then holds your code to the contracts the reference
keeps: equal to the exact result, bytes counted by the traffic ledger, a memory budget kept. Run them
with `python -m pytest -q tests/course/test_extensions.py` (E2) and under
`mpiexec -n K python -m pytest -m mpi tests/course/test_extensions.py` (E1: K = 2, 4, 8; E3: K = 4).
Lesson: lessons/course.md.
"""

from __future__ import annotations


def recursive_doubling_all_reduce(comm, x):
    """E1 (lesson 02): the sum of x over comm's ranks, by recursive doubling.

    In round r = 0, 1, ..., log2(N) - 1 every rank exchanges its whole partial sum with the rank whose
    number differs in bit r (`comm.sendrecv`) and adds what arrives: log2(N) messages of S bytes, where
    the ring sends 2(N-1) messages of S/N. Fewer, larger messages: better when latency dominates.
    Contract: integers equal MPI's sum, floats to 1e-12; every rank sends log2(N)·S bytes (N a power
    of two). Return your result here; None means not built yet."""
    return None


def zero3_prefetch_plan(sizes: list[int], budget_bytes: int):
    """E2 (lesson 04): a prefetch policy for ZeRO-3 of your design, as a plan.

    One step uses the units in the order forward 0, 1, ..., L-1, then backward L-1, ..., 0 (2L uses;
    sizes[u] = the bytes of unit u's full parameters). A unit must be whole (gathered) when it is used
    and is released right after, unless the next use is the same unit. Return a list of 2L lists: at
    use t, the units to start gathering now for a later use (a prefetch, which hides the gather behind
    use t's compute). A use whose unit is not whole waits for a gather of its own: a stall.
    Contract (tests/course/test_extensions.py simulates the plan): every gather is used (the bytes are
    no-prefetch ZeRO-3's), the whole units never hold more than budget_bytes, and there are no more
    stalls than a greedy one-ahead policy has under the same budget. Return your plan here."""
    return None


def summa_matmul(a_block, b_block, rows, columns):
    """E3 (lesson 05b): a 2D tensor-parallel matmul C = A @ B on a q x q grid of ranks (SUMMA).

    Rank (i, j) holds block (i, j) of A and of B (n/q x n/q each); `rows` is the communicator of the
    ranks (i, 0..q-1), ranked by j, `columns` that of (0..q-1, j), ranked by i. Return block (i, j) of C:
    for k in 0..q-1, broadcast A(i, k) along the row and B(k, j) along the column, and accumulate
    A(i, k) @ B(k, j). Contract: equal to the full product's block to 1e-12; every rank sends no more
    than 2q blocks' bytes (1-D tensor parallelism gathers a whole operand). Return your block here."""
    return None
