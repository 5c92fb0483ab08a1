package doctest

import (
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/grpc/codes"
	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"

	"github.com/qemu-kubelet/qemu-kubelet/controller"
	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/provider/telemetry"
)

// registered is a prometheus.Registerer that records the families
// registered with it, from the collectors' own Describe (names, label
// names, also of vectors without series) and Collect (the series they
// export from the start, with their label values).
type registered map[string]*Family

var descString = regexp.MustCompile(`^Desc\{fqName: "([^"]+)", help: .*, variableLabels: \{([^}]*)\}\}$`)

func (r registered) Register(c prometheus.Collector) error {
	typ := ""
	switch c.(type) {
	case *prometheus.CounterVec, prometheus.Counter:
		typ = "counter"
	case *prometheus.GaugeVec, prometheus.Gauge:
		typ = "gauge"
	case *prometheus.HistogramVec, prometheus.Histogram:
		typ = "histogram"
	case *prometheus.SummaryVec, prometheus.Summary:
		typ = "summary"
	}
	descs := make(chan *prometheus.Desc)
	go func() { c.Describe(descs); close(descs) }()
	for d := range descs {
		m := descString.FindStringSubmatch(d.String())
		if m == nil {
			return fmt.Errorf("cannot read %s", d)
		}
		f := &Family{Type: typ, Labels: []string{}, Values: map[string][]string{}}
		for _, l := range strings.Split(m[2], ",") {
			if l = strings.TrimSuffix(strings.TrimPrefix(strings.TrimSpace(l), "c("), ")"); l != "" {
				f.Labels = append(f.Labels, l)
			}
		}
		r[m[1]] = f
	}
	metrics := make(chan prometheus.Metric)
	go func() { c.Collect(metrics); close(metrics) }()
	for m := range metrics {
		var pb dto.Metric
		if err := m.Write(&pb); err != nil {
			return err
		}
		d := descString.FindStringSubmatch(m.Desc().String())
		if d == nil || r[d[1]] == nil {
			continue
		}
		f := r[d[1]]
		if f.Type == "" { // a collector of several types (runtime, process, state)
			switch {
			case pb.Counter != nil:
				f.Type = "counter"
			case pb.Gauge != nil:
				f.Type = "gauge"
			case pb.Histogram != nil:
				f.Type = "histogram"
			case pb.Summary != nil:
				f.Type = "summary"
			}
		}
		for _, lp := range pb.Label {
			if !slices.Contains(f.Values[lp.GetName()], lp.GetValue()) {
				f.Values[lp.GetName()] = append(f.Values[lp.GetName()], lp.GetValue())
			}
		}
	}
	return nil
}

func (r registered) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := r.Register(c); err != nil {
			panic(err)
		}
	}
}

func (r registered) Unregister(prometheus.Collector) bool { return false }

// binaries are the families the two binaries register, from their own
// registration code: the node agent's telemetry.RegisterMetrics and its
// scrape-time telemetry.StateCollector (cmd/qemu-kubelet), the
// controller's controller.NewMetrics; families registered by
// controller-runtime itself (controller_runtime_*, workqueue_*) are found
// in its registry by name (their label names it does not tell).
func binaries(t *testing.T) func(string) (*Family, bool) {
	t.Helper()
	r := registered{}
	if _, err := telemetry.RegisterMetrics(r); err != nil {
		t.Fatal(err)
	}
	if err := r.Register(telemetry.StateCollector{}); err != nil {
		t.Fatal(err)
	}
	if _, err := controller.NewMetrics(r); err != nil {
		t.Fatal(err)
	}
	return func(name string) (*Family, bool) {
		if f, ok := r[name]; ok {
			return f, true
		}
		if inRegistry(ctrlmetrics.Registry, name) {
			return &Family{}, true
		}
		return nil, false
	}
}

// inRegistry tells whether reg has a family called name: registering a
// collector of that name succeeds (and is undone) when it has none, and
// fails as a duplicate name when it has one.
func inRegistry(reg prometheus.Registerer, name string) bool {
	probe := prometheus.NewGauge(prometheus.GaugeOpts{Name: name, Help: "doctest probe for a documented metric"})
	err := reg.Register(probe)
	if err == nil {
		reg.Unregister(probe)
		return false
	}
	var dup prometheus.AlreadyRegisteredError
	return errors.As(err, &dup) || strings.Contains(err.Error(), "previously registered descriptor with the same fully-qualified name")
}

// TestDocsMetrics: every metric the docs' metric tables name is one the
// binaries register, with the documented type and exactly the documented
// label names; every label value listed is one the family exports from the
// start or a string the code holds, and a closed list names every value
// exported from the start; every qemu_kubelet_* family the binaries
// register has a row in docs/observability.md.
func TestDocsMetrics(t *testing.T) {
	root, err := testutil.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	lits, err := StringLiterals(root)
	if err != nil {
		t.Fatal(err)
	}
	lookup := binaries(t)
	// The code label of the driver calls is a gRPC status code's name.
	for c := codes.OK; c <= codes.Unauthenticated; c++ {
		lits[c.String()] = true
	}
	known := func(v string) bool { return lits[v] }
	tables := 0
	docs, err := ReadAll(UserDocs...)
	if err != nil {
		t.Fatal(err)
	}
	var inObservability []string
	for _, path := range slices.Sorted(func(yield func(string) bool) {
		for p := range docs {
			if !yield(p) {
				return
			}
		}
	}) {
		for _, tab := range docs[path].Tables() {
			if len(tab.Header) == 0 || tab.Header[0] != "Metric" {
				continue
			}
			tables++
			errs, names := MetricTableErrors(path, tab, lookup, known)
			for _, e := range errs {
				t.Error(e)
			}
			if path == "docs/observability.md" {
				inObservability = append(inObservability, names...)
			}
		}
	}
	if tables < 3 {
		t.Fatalf("found %d metric tables (first column Metric) in the docs, want the node agent's, the controller's and the exporter's", tables)
	}
	r := registered{}
	if _, err := telemetry.RegisterMetrics(r); err != nil {
		t.Fatal(err)
	}
	if err := r.Register(telemetry.StateCollector{}); err != nil {
		t.Fatal(err)
	}
	if _, err := controller.NewMetrics(r); err != nil {
		t.Fatal(err)
	}
	n := 0
	for name := range r {
		if !strings.HasPrefix(name, "qemu_kubelet_") {
			continue
		}
		n++
		if !slices.Contains(inObservability, name) {
			t.Errorf("metric %s is registered but has no row in docs/observability.md", name)
		}
	}
	if n < 20 {
		t.Fatalf("only %d qemu_kubelet_* families registered: is the registration read?", n)
	}
}
