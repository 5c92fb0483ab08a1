package main

import (
	"fmt"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
)

// PlotBurst draws create->Ready and create->boot marker against N, for the
// pods and for the bare QEMU baseline of the same run, into a PNG.
func PlotBurst(pts []BurstPoint, path string) error {
	p := plot.New()
	p.Title.Text = "Burst of N VM pods on one node vs N bare QEMU (same run)"
	p.X.Label.Text = "N (pods created at once)"
	p.Y.Label.Text = "seconds from the first create"
	series := func(f func(BurstPoint) float64) plotter.XYs {
		xy := make(plotter.XYs, len(pts))
		for i, pt := range pts {
			xy[i].X, xy[i].Y = float64(pt.N), f(pt)
		}
		return xy
	}
	if err := plotutil.AddLinePoints(p,
		"pods: all Ready", series(func(b BurstPoint) float64 { return b.Ready }),
		"bare: all QMP up + scheduler binding", series(func(b BurstPoint) float64 { return b.BareQMPPlusBind }),
		"pods: all at boot marker", series(func(b BurstPoint) float64 { return b.Marker }),
		"bare: all at boot marker", series(func(b BurstPoint) float64 { return b.BareMarker }),
	); err != nil {
		return fmt.Errorf("add lines: %w", err)
	}
	p.Legend.Top, p.Legend.Left = true, true
	return p.Save(8*vg.Inch, 5*vg.Inch, path)
}
