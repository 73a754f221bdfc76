//! Line plots (SVG) for the report.

use std::path::Path;

use anyhow::Result;
use plotters::prelude::*;

pub fn plot_lines(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[(&str, Vec<(f64, f64)>)],
) -> Result<()> {
    let root = SVGBackend::new(path, (720, 440)).into_drawing_area();
    root.fill(&WHITE)?;
    let xs = series.iter().flat_map(|(_, p)| p.iter().map(|q| q.0));
    let ys = series.iter().flat_map(|(_, p)| p.iter().map(|q| q.1));
    let (x0, x1) = xs.fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(x), b.max(x)));
    // Headroom above the highest point for the legend.
    let y1 = ys.fold(0f64, f64::max) * 1.35;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(x0..x1.max(x0 + 1.0), 0f64..y1.max(1.0))?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .draw()?;
    // Eight colours told apart in print (Okabe-Ito plus grey and black); a ninth series would
    // reuse one, never vanish.
    let colors = [
        RGBColor(0, 114, 178),
        RGBColor(213, 94, 0),
        RGBColor(0, 158, 115),
        RGBColor(204, 121, 167),
        RGBColor(230, 159, 0),
        RGBColor(86, 180, 233),
        RGBColor(120, 120, 120),
        RGBColor(0, 0, 0),
    ];
    for ((name, points), &color) in series.iter().zip(colors.iter().cycle()) {
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
            .label(*name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}
