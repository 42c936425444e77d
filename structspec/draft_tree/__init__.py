"""Draft-tree layout and tree verification: the neutral types that the drafters, the runner,
the grammar mask build and the scheduler all share (none of them owns the others)."""
