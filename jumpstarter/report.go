package jumpstarter

import (
	"maps"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
)

// exporterLabels are the labels the exporter sends with Register and
// answers in GetReport: upstream's exporter sends {jumpstarter.dev/name:
// <its name>} (jumpstarter/config/exporter.py, create_exporter), and the
// controller replaces every jumpstarter.dev/ label of the Exporter object
// with the ones Register carries, so without it the object loses the label
// upstream's exporters keep there. The configured labels go with it; the
// exporter's own name wins over a configured jumpstarter.dev/name.
func exporterLabels(configured map[string]string, name string) map[string]string {
	l := maps.Clone(configured)
	if l == nil {
		l = map[string]string{}
	}
	l[LabelName] = name
	return l
}

// reports is the driver tree as the controller and clients see it.
func (e *Exporter) reports() []*pb.DriverInstanceReport {
	out := make([]*pb.DriverInstanceReport, len(e.tree))
	for i, d := range e.tree {
		out[i] = d.report()
	}
	return out
}
