//! Charts as SVG drawn on the server: no script, no external asset, and the same picture in a
//! browser, a screenshot or `curl`.

use maud::{html, Markup};

const WIDTH: f64 = 720.0;
const HEIGHT: f64 = 180.0;
const LEFT: f64 = 56.0;
const RIGHT: f64 = 28.0;
const TOP: f64 = 22.0;
const BOTTOM: f64 = 24.0;

/// One line: its CSS class (its colour) and legend, and its points `(x, y)` in data units.
pub(crate) struct Series<'a> {
    pub(crate) class: &'a str,
    pub(crate) label: &'a str,
    pub(crate) points: Vec<(f64, f64)>,
}

/// A chart: lines over `x_range`, the y axis from 0 to the largest value (at least
/// `y_floor`), labelled ticks along x, and vertical markers (a quota's resets).
pub(crate) struct Chart<'a> {
    pub(crate) id: &'a str,
    pub(crate) title: &'a str,
    pub(crate) x_range: (f64, f64),
    pub(crate) y_floor: f64,
    pub(crate) y_unit: &'a str,
    pub(crate) series: Vec<Series<'a>>,
    pub(crate) x_ticks: Vec<(f64, String)>,
    pub(crate) markers: Vec<f64>,
}

impl Chart<'_> {
    /// The chart as an inline `<svg>` element.
    pub(crate) fn render(&self) -> Markup {
        let y_max = self
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.1))
            .fold(self.y_floor, f64::max);
        let y_max = nice_ceiling(y_max);
        let (x0, x1) = self.x_range;
        let span = (x1 - x0).max(f64::MIN_POSITIVE);
        let px = |x: f64| LEFT + (x - x0) / span * (WIDTH - LEFT - RIGHT);
        let py = |y: f64| TOP + (1.0 - y / y_max) * (HEIGHT - TOP - BOTTOM);
        let view_box = format!("0 0 {WIDTH} {HEIGHT}");
        html! {
            figure.chart {
                svg id=(self.id) viewBox=(view_box) role="img" aria-label=(self.title) xmlns="http://www.w3.org/2000/svg" {
                    title { (self.title) }
                    line.axis x1=(LEFT) y1=(py(0.0)) x2=(WIDTH - RIGHT) y2=(py(0.0)) {}
                    line.axis x1=(LEFT) y1=(TOP) x2=(LEFT) y2=(py(0.0)) {}
                    line.grid x1=(LEFT) y1=(py(y_max)) x2=(WIDTH - RIGHT) y2=(py(y_max)) {}
                    text.label x=(LEFT - 4.0) y=(py(y_max) + 4.0) text-anchor="end" { (number(y_max)) }
                    text.label x=(LEFT - 4.0) y=(py(0.0) + 4.0) text-anchor="end" { "0" }
                    text.label x=(LEFT) y=(12) { (self.y_unit) }
                    @for (x, label) in &self.x_ticks {
                        line.grid x1=(px(*x)) y1=(TOP) x2=(px(*x)) y2=(py(0.0)) {}
                        text.label x=(px(*x)) y=(HEIGHT - 6.0) text-anchor="middle" { (label) }
                    }
                    @for x in &self.markers {
                        line.marker x1=(px(*x)) y1=(TOP) x2=(px(*x)) y2=(py(0.0)) {}
                    }
                    @for s in &self.series {
                        polyline class=(s.class) fill="none" points=(points(&s.points, px, py)) {}
                    }
                }
                figcaption {
                    @for s in &self.series {
                        span class=(format!("key {}", s.class)) { (s.label) }
                    }
                }
            }
        }
    }
}

/// `x,y x,y ...` in pixels.
fn points(data: &[(f64, f64)], px: impl Fn(f64) -> f64, py: impl Fn(f64) -> f64) -> String {
    let mut out = String::with_capacity(data.len() * 14);
    for (x, y) in data {
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(&format!("{:.1},{:.1}", px(*x), py(*y)));
    }
    out
}

/// The smallest of 1, 2 and 5 times a power of ten at or above `v` (1 for nothing).
fn nice_ceiling(v: f64) -> f64 {
    if v.is_nan() || v <= 0.0 || !v.is_finite() {
        return 1.0;
    }
    let power = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * power)
        .find(|c| *c >= v * (1.0 - 1e-12))
        .unwrap_or(10.0 * power)
}

/// A figure for an axis: whole when whole, else up to three decimals.
pub(crate) fn number(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.0}")
    } else {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    }
}

/// Points of a step line: each value holds from its `x` to the next's (the last to `end`).
pub(crate) fn steps(changes: &[(f64, f64)], end: f64) -> Vec<(f64, f64)> {
    let mut out = Vec::with_capacity(changes.len() * 2);
    for (i, (x, y)) in changes.iter().enumerate() {
        out.push((*x, *y));
        let until = changes.get(i + 1).map_or(end, |next| next.0);
        out.push((until, *y));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axis_ceilings_are_round() {
        assert_eq!(nice_ceiling(0.0), 1.0);
        assert_eq!(nice_ceiling(7.0), 10.0);
        assert_eq!(nice_ceiling(10.0), 10.0);
        assert_eq!(nice_ceiling(11.0), 20.0);
        assert_eq!(nice_ceiling(0.3), 0.5);
        assert_eq!(number(2.5), "2.5");
        assert_eq!(number(100.0), "100");
    }

    #[test]
    fn steps_hold_each_value_until_the_next() {
        assert_eq!(
            steps(&[(0.0, 5.0), (2.0, 3.0)], 4.0),
            vec![(0.0, 5.0), (2.0, 5.0), (2.0, 3.0), (4.0, 3.0)]
        );
    }

    #[test]
    fn a_chart_escapes_its_labels() {
        let chart = Chart {
            id: "c",
            title: "<script>",
            x_range: (0.0, 1.0),
            y_floor: 1.0,
            y_unit: "tokens",
            series: vec![Series {
                class: "decisions",
                label: "a&b",
                points: vec![(0.0, 0.0), (1.0, 1.0)],
            }],
            x_ticks: vec![],
            markers: vec![],
        };
        let svg = chart.render().into_string();
        assert!(svg.contains("&lt;script&gt;") && svg.contains("a&amp;b"), "{svg}");
        assert!(svg.contains("polyline class=\"decisions\""), "{svg}");
    }
}
