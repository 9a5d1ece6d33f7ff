"""The speed layer: faster forms of the bottom layer's hot kernels, kept apart from the plain ones.

`minipar.core` is written the way a student would write it: one new array per operation, `a @ b` for
every product, malloc as the C library sets it up. The forms here do the same work faster, and each
is checked against the plain form it replaces:

    rules.py      GELU's forward and backward, AdamW's update: the plain forms' operations in place,
                  tile by tile over large arrays (tiles.py): the same bits
    blas.py       Linear's 2-D products through Intel's MKL (MINIPAR_BLAS=mkl, optional): products
                  rounded in MKL's order, so never by default
    allocator.py  glibc's mallopt: freed memory kept in the process for the next step (no numbers change)

They reach core only through its kernel table (core/kernels.py: `install` returns a removable handle);
core never imports this package, and a layer above it chooses (install.py: `minipar` installs the
rules and the allocator setting at start-up, and every training step runs with the rules, unless
MINIPAR_KERNELS=plain). In the layer order this package sits directly above core, beside
distributed; it imports nothing but core.

What it saves: about half of GELU's time, a few percent of AdamW's, a quarter of a small step's time
in page faults, and with MKL up to a quarter of Linear's. What it costs: a second copy of each rule,
kept equal to the first by tests/speed.
Lesson: lessons/01b_speed_appendix.md ("The speed layer").
"""
