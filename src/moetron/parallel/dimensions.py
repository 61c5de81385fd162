"""Every parallel dimension, registered once: `validate()` and `plan/` iterate over `DIMENSIONS`.

The order is the order their problems are reported in (ZeRO's flags, tensor then context parallelism's splits, the
pipeline's flags, expert parallelism's). Adding a dimension: its folder `parallel/<dim>/` with a `dimension.py`
(docs/architecture.md, "Adding a parallel dimension"), and one line here.
"""

from __future__ import annotations

from moetron.parallel.cp import dimension as cp
from moetron.parallel.dimension import Dimension
from moetron.parallel.dp import dimension as dp
from moetron.parallel.ep import dimension as ep
from moetron.parallel.pp import dimension as pp
from moetron.parallel.tp import dimension as tp

DIMENSIONS: tuple[Dimension, ...] = (dp.DIMENSION, tp.DIMENSION, cp.DIMENSION, pp.DIMENSION, ep.DIMENSION)
