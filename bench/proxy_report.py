"""The proxy bench's report: figures in units, rows printed as they are measured and as tables
at the end, and the figures taken of knit-proxyd and kube-proxy alike, set side by side."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.proxy_cluster import CHURN_CHANGES
from bench.proxy_daemon import KNIT, KUBE_PROXY
from bench.proxy_modes import Mode


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def secs(seconds: float) -> str:
    return f"{seconds:.2f} s"


@dataclass(frozen=True)
class Row:
    mode: str
    size: int
    figure: str
    knit: str
    anchor: str = ""
    ratio: str = ""
    goal: str = ""


def columns(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """Rows as a table of left-aligned columns under a header."""
    cells = [header, *rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


@dataclass
class Report:
    """Figures as measured: printed at once, and as tables at the end."""

    rows: list[Row] = field(default_factory=list)

    def add(self, row: Row) -> None:
        self.rows.append(row)
        extra = "".join(
            f" | {label} {value}"
            for label, value in (("anchor", row.anchor), ("ratio", row.ratio), ("goal", row.goal))
            if value
        )
        print(f"  {row.figure}: {row.knit}{extra}", flush=True)

    def table(self) -> str:
        header = ("mode", "N", "figure", "knit-proxyd", "anchor", "ratio", "goal")
        return columns(
            header,
            [(r.mode, str(r.size), r.figure, r.knit, r.anchor, r.ratio, r.goal) for r in self.rows],
        )

    def comparison(self, modes: list[str]) -> str:
        """One line per N and figure: each mode's figure with its ratio to its anchor, and
        the judged mode's goal."""
        cells: dict[tuple[int, str], dict[str, Row]] = {}
        for row in self.rows:
            if row.mode in modes:
                cells.setdefault((row.size, row.figure), {})[row.mode] = row
        lines = []
        for (size, figure), by_mode in sorted(cells.items(), key=lambda item: item[0][0]):
            values = (cell(by_mode.get(mode)) for mode in modes)
            goal = next((r.goal for r in by_mode.values() if r.goal), "")
            lines.append((str(size), figure, *values, goal))
        return columns(("N", "figure", *modes, "goal (nftables)"), lines)


def paired(rates: dict[str, list[float]], kind: str, anchor: str) -> float:
    """The median of the rounds' own ratios of kind's rate to anchor's."""
    return statistics.median(a / b for a, b in zip(rates[kind], rates[anchor], strict=True))


def cell(row: Row | None) -> str:
    if row is None:
        return ""
    return f"{row.knit} ({row.ratio})" if row.ratio else row.knit


def ratio(value: float, anchor: float) -> str:
    return times(value / anchor)


def times(factor: float) -> str:
    return f"{factor:.2f}x"


def mib(value: float) -> str:
    return f"{value:.0f} MiB"


@dataclass(frozen=True)
class Figure:
    """A figure taken of knit-proxyd and of kube-proxy alike, to be set side by side."""

    name: str
    unit: Callable[[float], str]
    higher_is_better: bool = False
    goal: float = 1.0
    """knit's figure against kube-proxy's, judged in the nftables mode at the largest N."""


COLD = Figure("cold start to the first full sync done (wall)", secs)
FIRST = Figure("first full sync (metric)", secs)
STEADY = Figure("full sync at steady state (metric, median)", secs)
PARTIAL_SYNC = Figure("one-service change: partial sync (metric, median)", ms, goal=0.1)
PROGRAMMED = Figure(
    "one-service change: API to rules in kernel (network programming metric, median)",
    ms,
    goal=0.1,
)
CONNECTIONS = Figure(
    "TCP connections/s via ClusterIP, as a share of direct through a node without rules",
    times,
    higher_is_better=True,
)
RSS_START = Figure("memory after start (VmRSS)", mib)
RSS_PEAK = Figure("memory peak (VmHWM)", mib)
CHURN = Figure(f"CPU time over a churn of {CHURN_CHANGES:,} endpoint changes", secs)
IDLE = Figure("CPU time per minute at idle, after the first full sync", secs)
BESIDE = (
    COLD, FIRST, STEADY, PARTIAL_SYNC, PROGRAMMED, CONNECTIONS, RSS_START, RSS_PEAK, CHURN, IDLE,
)  # fmt: skip


class Results:
    """The run's figures: each a row of the report, and those taken of both programs kept to
    be set side by side."""

    def __init__(self) -> None:
        self.report = Report()
        self.beside: dict[tuple[str, int], dict[Figure, dict[str, float]]] = {}
        """(mode, N) -> figure -> program -> value."""

    def add(
        self,
        mode: Mode,
        size: int,
        figure: str,
        knit: str,
        anchor: str = "",
        ratio: str = "",
        goal: tuple[str, bool] | None = None,
    ) -> None:
        """Report a figure; `goal` (its text, whether it is met) counts in a judged mode."""
        judged = f"{goal[0]}: {'met' if goal[1] else 'NOT met'}" if goal and mode.judged else ""
        self.report.add(Row(mode.name, size, figure, knit, anchor, ratio, judged))

    def keep(self, mode: Mode, size: int, figure: Figure, program: str, value: float) -> None:
        """A figure of one program, for the comparison of the two."""
        self.beside.setdefault((mode.name, size), {}).setdefault(figure, {})[program] = value

    def note(self, mode: Mode, size: int, figure: Figure, program: str, value: float) -> None:
        """A figure kept for the comparison that no row of the report shows: printed at once."""
        self.keep(mode, size, figure, program, value)
        print(f"  {figure.name}: {figure.unit(value)}", flush=True)

    def beside_kube_proxy(self, largest: int) -> None:
        """knit-proxyd's figures beside kube-proxy's, each a row of the report: the ratio is
        knit's to kube-proxy's, judged (in the nftables mode at the largest N) against the
        figure's goal: at or ahead of kube-proxy, a one-service change a tenth of its."""
        print("\nknit-proxyd beside kube-proxy:", flush=True)
        for (mode_name, size), figures in self.beside.items():
            for figure in BESIDE:
                values = figures.get(figure, {})
                if KNIT not in values or KUBE_PROXY not in values:
                    continue
                knit, peer = values[KNIT], values[KUBE_PROXY]
                # idle CPU can be zero at the clock's 10-ms ticks: equal when both are
                factor = knit / peer if peer else (1.0 if not knit else math.inf)
                met = factor >= figure.goal if figure.higher_is_better else factor <= figure.goal
                sign = ">=" if figure.higher_is_better else "<="
                goal = f"{sign} {figure.goal:g}x: {'met' if met else 'NOT met'}"
                judged = mode_name == "nftables" and size == largest
                self.report.add(
                    Row(
                        mode_name,
                        size,
                        f"beside kube-proxy: {figure.name}",
                        figure.unit(knit),
                        f"kube-proxy {figure.unit(peer)}",
                        times(factor),
                        goal if judged else "",
                    )
                )
