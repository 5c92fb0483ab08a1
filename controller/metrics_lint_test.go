package controller

import (
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/types"
	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"
)

// TestMetricsLint: the ExporterSet gauges follow the Prometheus naming
// conventions (promlint), carry the set's labels and are removed with the
// set; the binary's registry (controller-runtime's, where NewMetrics
// registers them next to controller_runtime_reconcile_time_seconds) has
// no lint problem in qemu_kubelet_* families.
func TestMetricsLint(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := NewMetrics(reg)
	require.NoError(t, err)
	key := types.NamespacedName{Namespace: "lab", Name: "boards"}
	m.observe(key, Status{Replicas: 5, Desired: 5, Ready: 4, Available: 3, Leased: 1, PendingLeases: 2})

	problems, err := lint(reg)
	require.NoError(t, err)
	assert.Empty(t, problems)
	n, err := testutil.GatherAndCount(reg)
	require.NoError(t, err)
	assert.Equal(t, 6, n, "six gauges for the one set")
	assert.Equal(t, 3.0, testutil.ToFloat64(m.available.WithLabelValues("lab", "boards")), "the warm buffer")
	assert.Equal(t, 2.0, testutil.ToFloat64(m.pending.WithLabelValues("lab", "boards")), "pending leases")
	m.forget(key)
	n, err = testutil.GatherAndCount(reg)
	require.NoError(t, err)
	assert.Equal(t, 0, n, "a deleted set leaves no series")

	// The binary's registry: register there as main does (a fresh
	// registration would collide if main's code ran in this process).
	m2, err := NewMetrics(ctrlmetrics.Registry)
	require.NoError(t, err)
	m2.observe(key, Status{Replicas: 1})
	t.Cleanup(func() { m2.forget(key) })
	all, err := lint(ctrlmetrics.Registry)
	require.NoError(t, err)
	for _, p := range all {
		if strings.HasPrefix(p.Metric, "qemu_kubelet_") {
			t.Errorf("promlint: %s: %s", p.Metric, p.Text)
		} else {
			t.Logf("promlint (upstream metric, not ours): %s: %s", p.Metric, p.Text)
		}
	}
}

func lint(g prometheus.Gatherer) ([]promlint.Problem, error) {
	mfs, err := g.Gather()
	if err != nil {
		return nil, err
	}
	return promlint.NewWithMetricFamilies(mfs).Lint()
}
