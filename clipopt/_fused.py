"""Where pickles made by clipopt 0.1.0 find the lagged skip count.

Such a pickle names ``clipopt._fused._LaggedCount``; the class is
:class:`clipopt._step._nonfinite.LaggedCount` today, and the fold that lived here is
:mod:`clipopt._step._fold`.
"""

from clipopt._step._nonfinite import LaggedCount

_LaggedCount = LaggedCount
