"""IPython startup file of template ``code-interpreter-v1`` (runs inside the sandbox's
Python kernel, from ``$IPYTHONDIR/profile_default/startup``).

Adds the two MIME types the ``e2b-code-interpreter`` SDKs read beside Jupyter's own:
``e2b/chart`` — a matplotlib Figure's chart data (title, axes, elements) as PyPI
``e2b-charts`` extracts it (the SDKs' ``result.chart``) — and ``e2b/data`` — a pandas
DataFrame's columns (``result.data``). Both are computed only for objects of libraries
already imported, so ``1 + 1`` imports neither.
"""

import sys

from IPython import get_ipython
from IPython.core.formatters import BaseFormatter
from traitlets import ObjectName, Unicode


class _ChartFormatter(BaseFormatter):
    format_type = Unicode("e2b/chart")
    print_method = ObjectName("_repr_e2b_chart_")
    _return_type = (dict, str)

    def __call__(self, obj):
        figure = getattr(sys.modules.get("matplotlib.figure"), "Figure", None)
        if figure is not None and isinstance(obj, figure):
            try:
                from e2b_charts import chart_figure_to_dict

                return chart_figure_to_dict(obj)
            except Exception:  # noqa: BLE001 — a figure e2b-charts cannot read has no chart
                return {}
        return super().__call__(obj)


class _DataFrameFormatter(BaseFormatter):
    format_type = Unicode("e2b/data")
    print_method = ObjectName("_repr_e2b_data_")
    _return_type = (dict, str)

    def __call__(self, obj):
        pandas = sys.modules.get("pandas")
        if pandas is not None and isinstance(obj, pandas.DataFrame):
            columns = obj.to_dict(orient="list")
            return {k: [v.isoformat() if isinstance(v, pandas.Timestamp) else v for v in vs]
                    for k, vs in columns.items()}
        return super().__call__(obj)


_formatter = get_ipython().display_formatter
for _cls in (_ChartFormatter, _DataFrameFormatter):
    _formatter.formatters[_cls.format_type.default_value] = _cls(parent=_formatter)
del _formatter, _cls
