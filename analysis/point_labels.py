"""Number labels beside a scatter's points that do not print over each other.

The Pareto figures (``analysis.figures``) number each setting's point and name the numbers in the legend. Points
of settings that differ only in a detail (INT8 weights, no clipping, BF16 state) sit a few pixels apart, and one
number per point printed them over each other. ``number_points`` joins the numbers of points that lie within
``NEAR`` of each other (a fraction of the panel's width and height, after the panel's limits are set) into one
label, "6, 9, 12", right of the cluster's rightmost point at the cluster's mean height.
"""

from __future__ import annotations

import numpy as np

NEAR = 0.045  # points closer than this share of the panel on both axes share one label


def clusters(xy: np.ndarray, near: float = NEAR) -> list[list[int]]:
    """Indices of ``xy`` (n, 2; in panel fractions) joined by single linkage: two points are in one cluster when
    a chain of points each within ``near`` of the next (on both axes) links them. Clusters in order of their
    first index, indices ascending within each."""
    parent = list(range(len(xy)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in range(len(xy)):
        for j in range(i + 1, len(xy)):
            if np.all(np.abs(xy[i] - xy[j]) < near):
                parent[root(j)] = root(i)
    found: dict[int, list[int]] = {}
    for i in range(len(xy)):
        found.setdefault(root(i), []).append(i)
    return list(found.values())


def number_points(ax, points: list[tuple[float, float, int]], near: float = NEAR) -> list[str]:
    """Annotates ``ax`` with each point's number, (x, y, number) in data coordinates, nearby points' numbers
    joined into one label; returns the labels written (for tests)."""
    if not points:
        return []
    ax.autoscale_view()
    data = np.array([(x, y) for x, y, _ in points], dtype=float)
    fractions = (ax.transScale + ax.transLimits).transform(data)
    labels = []
    for members in clusters(fractions, near):
        right = max(members, key=lambda i: fractions[i][0])
        height = float(np.mean(fractions[members, 1]))
        text = ", ".join(str(points[i][2]) for i in sorted(members, key=lambda i: points[i][2]))
        ax.annotate(text, (float(fractions[right][0]), height), xycoords="axes fraction", textcoords="offset points",
                    xytext=(6, 0), va="center", fontsize="x-small")
        labels.append(text)
    return labels
