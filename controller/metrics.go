package controller

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/types"
)

// Metrics are per-set gauges for Prometheus and KEDA, labelled with the
// set's namespace and name.
type Metrics struct {
	desired, current, ready, available, leased, pending *prometheus.GaugeVec
}

// NewMetrics creates the gauges and registers them with reg (the manager's
// metrics.Registry in the binary, a fresh registry in tests).
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	gauge := func(name, help string) *prometheus.GaugeVec {
		return prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: "qemu_kubelet", Subsystem: "exporterset", Name: name, Help: help,
		}, []string{"namespace", "exporterset"})
	}
	m := &Metrics{
		desired:   gauge("desired_replicas", "Effective target number of pods: max(replicas, leased + pending leases + minAvailable), capped by maxReplicas."),
		current:   gauge("replicas", "Pods owned by the ExporterSet, neither terminating nor finished."),
		ready:     gauge("ready_replicas", "Ready pods of the ExporterSet."),
		available: gauge("available_replicas", "Ready, unleased pods of the ExporterSet (the warm buffer)."),
		leased:    gauge("leased_replicas", "Leased pods of the ExporterSet."),
		pending:   gauge("pending_leases", "Jumpstarter Leases waiting for an exporter of the ExporterSet (Jumpstarter mode)."),
	}
	for _, c := range []prometheus.Collector{m.desired, m.current, m.ready, m.available, m.leased, m.pending} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register exporterset metrics: %w", err)
		}
	}
	return m, nil
}

func (m *Metrics) observe(key types.NamespacedName, st Status) {
	if m == nil {
		return
	}
	l := prometheus.Labels{"namespace": key.Namespace, "exporterset": key.Name}
	m.desired.With(l).Set(float64(st.Desired))
	m.current.With(l).Set(float64(st.Replicas))
	m.ready.With(l).Set(float64(st.Ready))
	m.available.With(l).Set(float64(st.Available))
	m.leased.With(l).Set(float64(st.Leased))
	m.pending.With(l).Set(float64(st.PendingLeases))
}

func (m *Metrics) forget(key types.NamespacedName) {
	if m == nil {
		return
	}
	l := prometheus.Labels{"namespace": key.Namespace, "exporterset": key.Name}
	for _, g := range []*prometheus.GaugeVec{m.desired, m.current, m.ready, m.available, m.leased, m.pending} {
		g.Delete(l)
	}
}
