"""Geometry3k-style diagrams drawn with PIL from a task's parameters (no randomness here: the task
fixes the picture, so the same task always gives the same pixels).

Every number a problem needs is written in the picture, never in the question's text. Drawings
are to scale (as most Geometry3k diagrams are), labels use PIL's bundled default font.
"""

from __future__ import annotations

import math
from typing import Any, Callable

Point = tuple[float, float]
INK = (0, 0, 0)


def _font(px: int) -> Any:
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=px)  # scalable when Pillow has FreeType
    except (TypeError, ValueError, OSError, ImportError):
        return ImageFont.load_default()


def _unit(v: Point) -> Point:
    n = math.hypot(*v) or 1.0
    return (v[0] / n, v[1] / n)


def _sub(a: Point, b: Point) -> Point:
    return (a[0] - b[0], a[1] - b[1])


def _along(p: Point, d: Point, k: float) -> Point:
    return (p[0] + d[0] * k, p[1] + d[1] * k)


def _cross(a: Point, b: Point) -> float:
    return a[0] * b[1] - a[1] * b[0]


def _direction(degrees: float) -> Point:
    """A unit vector at `degrees` counter-clockwise from the x axis, in image coordinates (y down)."""
    return (math.cos(math.radians(degrees)), -math.sin(math.radians(degrees)))


class Canvas:
    """A white square picture with the few drawing moves the diagrams need."""

    def __init__(self, size: int):
        from PIL import Image, ImageDraw

        self.size = size
        self.image = Image.new("RGB", (size, size), "white")
        self.draw = ImageDraw.Draw(self.image)
        self.font = _font(max(10, size // 18))
        self.width = max(1, size // 128)

    def line(self, a: Point, b: Point, width: int | None = None) -> None:
        self.draw.line([a, b], fill=INK, width=width or self.width)

    def polygon(self, points: list[Point]) -> None:
        for a, b in zip(points, points[1:] + points[:1]):
            self.line(a, b)

    def dot(self, p: Point) -> None:
        r = max(2, self.size // 100)
        self.draw.ellipse([p[0] - r, p[1] - r, p[0] + r, p[1] + r], fill=INK)

    def text(self, p: Point, s: str) -> None:
        """`s` centred on p (computed from the bounding box, so bitmap fonts work too)."""
        left, top, right, bottom = self.draw.textbbox((0, 0), s, font=self.font)
        self.draw.text((p[0] - (left + right) / 2, p[1] - (top + bottom) / 2), s, fill=INK, font=self.font)

    def angle_mark(self, vertex: Point, a: Point, b: Point, label: str) -> None:
        """An arc inside the angle a-vertex-b and its label on the bisector, far enough out to fit."""
        u1, u2 = _unit(_sub(a, vertex)), _unit(_sub(b, vertex))
        start, end = (math.degrees(math.atan2(u[1], u[0])) % 360 for u in (u1, u2))
        if (end - start) % 360 > 180:
            start, end = end, start
        r = self.size * 0.05
        self.draw.arc([vertex[0] - r, vertex[1] - r, vertex[0] + r, vertex[1] + r], start, end, fill=INK, width=self.width)
        bisector = _unit((u1[0] + u2[0], u1[1] + u2[1]))
        left, top, right, bottom = self.draw.textbbox((0, 0), label, font=self.font)
        half_w, half_h, gap = (right - left) / 2 + 1, (bottom - top) / 2 + 1, self.size * 0.008
        distance = self.size * 0.11
        while distance < self.size * 0.3:  # out along the bisector until the label's box clears both sides
            c = _along(vertex, bisector, distance)
            corners = [(c[0] + sx * half_w - vertex[0], c[1] + sy * half_h - vertex[1]) for sx in (-1, 1) for sy in (-1, 1)]
            if all(_cross(u1, q) * _cross(u1, u2) > 0 and _cross(q, u2) * _cross(u1, u2) > 0
                   and min(abs(_cross(u1, q)), abs(_cross(u2, q))) >= gap for q in corners):
                break
            distance += 1
        self.text(_along(vertex, bisector, distance), label)

    def side_label(self, a: Point, b: Point, away_from: Point, label: str) -> None:
        """A label beside the middle of side a-b, on the side away from `away_from`."""
        mid = ((a[0] + b[0]) / 2, (a[1] + b[1]) / 2)
        normal = _unit((-(b[1] - a[1]), b[0] - a[0]))
        if normal[0] * (mid[0] - away_from[0]) + normal[1] * (mid[1] - away_from[1]) < 0:
            normal = (-normal[0], -normal[1])
        self.text(_along(mid, normal, self.size * 0.06), label)

    def tick(self, a: Point, b: Point) -> None:
        """The equal-length mark across the middle of a-b."""
        mid, normal = ((a[0] + b[0]) / 2, (a[1] + b[1]) / 2), _unit((-(b[1] - a[1]), b[0] - a[0]))
        k = self.size * 0.025
        self.line(_along(mid, normal, -k), _along(mid, normal, k))

    def vertex_names(self, points: list[Point], names: str) -> None:
        centre = (sum(p[0] for p in points) / len(points), sum(p[1] for p in points) / len(points))
        for p, name in zip(points, names):
            self.text(_along(p, _unit(_sub(p, centre)), self.size * 0.055), name)


def _fit(points: list[Point], rotation: float, size: int, margin: float = 0.16) -> list[Point]:
    """Points rotated about their centroid, then scaled and centred into the picture's margins."""
    cx, cy = sum(p[0] for p in points) / len(points), sum(p[1] for p in points) / len(points)
    c, s = math.cos(math.radians(rotation)), math.sin(math.radians(rotation))
    turned = [((x - cx) * c - (y - cy) * s, (x - cx) * s + (y - cy) * c) for x, y in points]
    xs, ys = [p[0] for p in turned], [p[1] for p in turned]
    scale = size * (1 - 2 * margin) / max(max(xs) - min(xs), max(ys) - min(ys), 1e-9)
    ox, oy = size / 2 - scale * (max(xs) + min(xs)) / 2, size / 2 - scale * (max(ys) + min(ys)) / 2
    return [(ox + scale * x, oy + scale * y) for x, y in turned]


def _triangle(alpha: float, beta: float) -> list[Point]:
    """A triangle with angle alpha at the first vertex and beta at the second (image coordinates)."""
    t = math.sin(math.radians(beta)) / math.sin(math.radians(alpha + beta))
    return [(0.0, 0.0), (1.0, 0.0), (t * math.cos(math.radians(alpha)), -t * math.sin(math.radians(alpha)))]


def _draw_triangle(canvas: Canvas, points: list[Point], names: str) -> None:
    canvas.polygon(points)
    canvas.vertex_names(points, names)


def triangle_angle_sum(canvas: Canvas, p: dict[str, Any]) -> None:
    angles, unknown = [int(a) for a in p["angles"]], int(p["unknown"])
    pts = _fit(_triangle(angles[0], angles[1]), float(p["rotation"]), canvas.size)
    _draw_triangle(canvas, pts, p["names"])
    for i in range(3):
        canvas.angle_mark(pts[i], pts[(i + 1) % 3], pts[(i + 2) % 3], "x°" if i == unknown else f"{angles[i]}°")


def right_triangle(canvas: Canvas, p: dict[str, Any]) -> None:
    a, b, c = (int(v) for v in p["sides"])  # legs a (first vertex to second) and b, hypotenuse c
    pts = _fit([(0.0, 0.0), (float(a), 0.0), (0.0, -float(b))], float(p["rotation"]), canvas.size)
    _draw_triangle(canvas, pts, p["names"])
    right, u1, u2 = pts[0], _unit(_sub(pts[1], pts[0])), _unit(_sub(pts[2], pts[0]))
    k = canvas.size * 0.045
    corner = [_along(right, u1, k), _along(_along(right, u1, k), u2, k), _along(right, u2, k)]
    canvas.line(corner[0], corner[1])
    canvas.line(corner[1], corner[2])
    centre = ((pts[0][0] + pts[1][0] + pts[2][0]) / 3, (pts[0][1] + pts[1][1] + pts[2][1]) / 3)
    unknown = p["unknown"]  # "hypotenuse" or "leg" (then b is x)
    canvas.side_label(pts[0], pts[1], centre, str(a))
    canvas.side_label(pts[0], pts[2], centre, "x" if unknown == "leg" else str(b))
    canvas.side_label(pts[1], pts[2], centre, "x" if unknown == "hypotenuse" else str(c))


def parallel_measure(theta: int, position: int) -> int:
    """The measure of the angle at `position` (0 upper right, 1 upper left, 2 lower left, 3 lower
    right) where a transversal rising at `theta` degrees crosses a horizontal line."""
    return theta if position in (0, 2) else 180 - theta


def parallel_lines(canvas: Canvas, p: dict[str, Any]) -> None:
    theta, size = int(p["theta"]), canvas.size
    ys, cot = (0.33 * size, 0.67 * size), 1 / math.tan(math.radians(theta))
    for y, name in zip(ys, "mn"):
        canvas.line((0.06 * size, y), (0.94 * size, y))
        x = 0.16 * size  # the arrowheads that say "parallel"
        canvas.line((x - 0.02 * size, y - 0.02 * size), (x, y))
        canvas.line((x - 0.02 * size, y + 0.02 * size), (x, y))
        canvas.text((0.95 * size, y - 0.05 * size), name)

    def x_at(y: float) -> float:  # where the transversal crosses height y
        return size / 2 - (y - size / 2) * cot

    canvas.line((x_at(0.06 * size), 0.06 * size), (x_at(0.94 * size), 0.94 * size))
    rays = [(1.0, 0.0), _direction(theta), (-1.0, 0.0), _direction(theta + 180)]
    for (line, position), label in ((p["given"], f"{parallel_measure(theta, int(p['given'][1]))}°"), (p["asked"], "x°")):
        vertex = (x_at(ys[int(line)]), ys[int(line)])
        a, b = rays[int(position)], rays[(int(position) + 1) % 4]
        canvas.angle_mark(vertex, _along(vertex, a, 10), _along(vertex, b, 10), label)


def circle(canvas: Canvas, p: dict[str, Any]) -> None:
    size, r = canvas.size, int(p["radius"])
    centre, radius_px = (size / 2, size / 2), size * 0.36
    canvas.draw.ellipse([centre[0] - radius_px, centre[1] - radius_px, centre[0] + radius_px, centre[1] + radius_px],
                        outline=INK, width=canvas.width)
    canvas.dot(centre)
    d_dir, r_dir = _direction(float(p["diameter_at"])), _direction(float(p["radius_at"]))
    ends = (_along(centre, d_dir, radius_px), _along(centre, d_dir, -radius_px))
    canvas.line(*ends)
    rim = _along(centre, r_dir, radius_px)
    canvas.line(centre, rim)
    for q in (*ends, rim):
        canvas.dot(q)
    diameter_label, radius_label = ("x", str(r)) if p["unknown"] == "diameter" else (str(2 * r), "x")
    normal = (-d_dir[1], d_dir[0])
    if normal[0] * r_dir[0] + normal[1] * r_dir[1] > 0:  # the diameter's label on the side away from the radius
        normal = (-normal[0], -normal[1])
    canvas.text(_along(_along(centre, d_dir, -radius_px * 0.5), normal, size * 0.05), diameter_label)
    canvas.side_label(centre, rim, _along(centre, d_dir, -radius_px * 0.3), radius_label)


def central_angle(canvas: Canvas, p: dict[str, Any]) -> None:
    size, angles, unknown = canvas.size, [int(a) for a in p["angles"]], int(p["unknown"])
    centre, radius_px = (size / 2, size / 2), size * 0.36
    canvas.draw.ellipse([centre[0] - radius_px, centre[1] - radius_px, centre[0] + radius_px, centre[1] + radius_px],
                        outline=INK, width=canvas.width)
    canvas.dot(centre)
    at = float(p["start"])
    for i, angle in enumerate(angles):
        rim = _along(centre, _direction(at), radius_px)
        canvas.line(centre, rim)
        canvas.dot(rim)
        canvas.text(_along(centre, _direction(at + angle / 2), size * 0.17), "x°" if i == unknown else f"{angle}°")
        at += angle


def isosceles(canvas: Canvas, p: dict[str, Any]) -> None:
    apex, base_vertex = int(p["apex"]), int(p["base_vertex"])
    base = (180 - apex) / 2
    pts = _fit(_triangle(base, base), float(p["rotation"]), canvas.size)
    _draw_triangle(canvas, pts, p["names"])
    canvas.tick(pts[0], pts[2])
    canvas.tick(pts[1], pts[2])
    apex_label, base_label = ("x°", f"{base:g}°") if p["unknown"] == "apex" else (f"{apex}°", "x°")
    canvas.angle_mark(pts[2], pts[0], pts[1], apex_label)
    canvas.angle_mark(pts[base_vertex], pts[1 - base_vertex], pts[2], base_label)


FAMILIES: dict[str, Callable[[Canvas, dict[str, Any]], None]] = {
    "triangle_angle_sum": triangle_angle_sum, "right_triangle": right_triangle, "parallel_lines": parallel_lines,
    "circle": circle, "central_angle": central_angle, "isosceles": isosceles,
}


def render(family: str, params: dict[str, Any], size: int = 256) -> Any:
    """The diagram of one generated problem (an RGB PIL image, size x size)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown geometry family {family!r}; use one of {sorted(FAMILIES)}")
    canvas = Canvas(int(size))
    FAMILIES[family](canvas, params)
    return canvas.image
