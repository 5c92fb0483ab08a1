package charts

import (
	"encoding/json"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/qemu-kubelet/qemu-kubelet/controller"
	"github.com/qemu-kubelet/qemu-kubelet/provider/telemetry"
)

const dashboardFile = chartDir + "/dashboards/qemu-kubelet.json"

// family is one metric family a binary exports: its type (histogram and
// summary families have suffixed series) and its labels.
type family struct {
	histogram, summary bool
	labels             []string
}

// inventory is a prometheus.Registerer that records what is registered
// with it, from the collectors' own Describe and Collect: every family,
// including vectors that have no series yet.
type inventory map[string]*family

var descRE = regexp.MustCompile(`^Desc\{fqName: "([^"]+)", help: .*, variableLabels: \{([^}]*)\}\}$`)

func (inv inventory) Register(c prometheus.Collector) error {
	descs := make(chan *prometheus.Desc)
	go func() { c.Describe(descs); close(descs) }()
	kind := func(f *family) {
		switch c.(type) {
		case *prometheus.HistogramVec, prometheus.Histogram:
			f.histogram = true
		case *prometheus.SummaryVec, prometheus.Summary:
			f.summary = true
		}
	}
	for d := range descs {
		m := descRE.FindStringSubmatch(d.String())
		if m == nil {
			return fmt.Errorf("cannot read %s", d)
		}
		f := &family{}
		for _, l := range strings.Split(m[2], ",") {
			if l = strings.TrimSuffix(strings.TrimPrefix(l, "c("), ")"); l != "" {
				f.labels = append(f.labels, l)
			}
		}
		kind(f)
		inv[m[1]] = f
	}
	// Collectors without a fixed type (runtime, process) say it per series.
	metrics := make(chan prometheus.Metric)
	go func() { c.Collect(metrics); close(metrics) }()
	for m := range metrics {
		var pb dto.Metric
		if err := m.Write(&pb); err != nil {
			return err
		}
		if d := descRE.FindStringSubmatch(m.Desc().String()); d != nil && inv[d[1]] != nil {
			inv[d[1]].histogram = inv[d[1]].histogram || pb.Histogram != nil
			inv[d[1]].summary = inv[d[1]].summary || pb.Summary != nil
		}
	}
	return nil
}

func (inv inventory) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := inv.Register(c); err != nil {
			panic(err)
		}
	}
}

func (inv inventory) Unregister(prometheus.Collector) bool { return false }

// series is every series name of the families, with their labels: a
// histogram's _bucket (with le), _sum and _count, a summary's quantiles.
func (inv inventory) series() map[string][]string {
	out := map[string][]string{}
	for name, f := range inv {
		switch {
		case f.histogram:
			out[name+"_bucket"] = append(slices.Clone(f.labels), "le")
			out[name+"_sum"], out[name+"_count"] = f.labels, f.labels
		case f.summary:
			out[name] = append(slices.Clone(f.labels), "quantile")
			out[name+"_sum"], out[name+"_count"] = f.labels, f.labels
		default:
			out[name] = f.labels
		}
	}
	return out
}

// exported is what the two binaries serve on /metrics, from their own
// registration code: the node agent's telemetry.RegisterMetrics plus its
// scrape-time telemetry.StateCollector (cmd/qemu-kubelet), and the
// controller's controller.NewMetrics.
func exported(t *testing.T) map[string][]string {
	t.Helper()
	inv := inventory{}
	_, err := telemetry.RegisterMetrics(inv)
	require.NoError(t, err)
	require.NoError(t, inv.Register(telemetry.StateCollector{}))
	_, err = controller.NewMetrics(inv)
	require.NoError(t, err)
	return inv.series()
}

// Labels Prometheus adds to every scraped series (target labels).
var targetLabels = []string{"instance", "job", "pod", "container", "endpoint", "service"}

// promqlRefs returns the metric names an expression refers to and, per
// metric, the label names its selector matches on. It is a tokenizer, not
// a full PromQL parser: enough for the dashboard's expressions (strings,
// range and offset brackets, function calls, by/without/on/ignoring
// label lists and Grafana variables are skipped).
func promqlRefs(expr string) (map[string][]string, error) {
	keywords := map[string]bool{"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true,
		"and": true, "or": true, "unless": true, "bool": true, "offset": true}
	aggregations := map[string]bool{"sum": true, "min": true, "max": true, "avg": true, "group": true, "stddev": true, "stdvar": true,
		"count": true, "count_values": true, "bottomk": true, "topk": true, "quantile": true, "limitk": true, "limit_ratio": true}
	refs := map[string][]string{}
	s := expr
	for len(s) > 0 {
		c := s[0]
		switch {
		case c == '"' || c == '\'' || c == '`':
			end := strings.IndexByte(s[1:], c)
			if end < 0 {
				return nil, fmt.Errorf("unterminated string in %q", expr)
			}
			s = s[end+2:]
		case c == '[':
			end := strings.IndexByte(s, ']')
			if end < 0 {
				return nil, fmt.Errorf("unterminated [ in %q", expr)
			}
			s = s[end+1:]
		case c == '$':
			s = strings.TrimLeft(s[1:], "_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
		case c == '_' || c == ':' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z':
			n := 1
			for n < len(s) && (s[n] == '_' || s[n] == ':' || s[n] >= 'a' && s[n] <= 'z' || s[n] >= 'A' && s[n] <= 'Z' || s[n] >= '0' && s[n] <= '9') {
				n++
			}
			word, rest := s[:n], strings.TrimLeft(s[n:], " \t\n")
			s = rest
			switch {
			case keywords[word]:
				if strings.HasPrefix(rest, "(") { // a label list
					end := strings.IndexByte(rest, ')')
					if end < 0 {
						return nil, fmt.Errorf("unterminated label list in %q", expr)
					}
					s = rest[end+1:]
				}
			case strings.HasPrefix(rest, "(") || aggregations[word]: // a function or aggregation (sum by (x) (...))
			default:
				labels := []string{}
				if strings.HasPrefix(rest, "{") {
					end := strings.IndexByte(rest, '}')
					if end < 0 {
						return nil, fmt.Errorf("unterminated selector in %q", expr)
					}
					for _, m := range regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)`).FindAllStringSubmatch(rest[1:end], -1) {
						labels = append(labels, m[1])
					}
					s = rest[end+1:]
				}
				refs[word] = append(refs[word], labels...)
			}
		default:
			s = s[1:]
		}
	}
	return refs, nil
}

// checkQuery returns what is wrong with expr against the exported series.
func checkQuery(expr string, series map[string][]string) []string {
	refs, err := promqlRefs(expr)
	if err != nil {
		return []string{err.Error()}
	}
	var bad []string
	if len(refs) == 0 {
		bad = append(bad, fmt.Sprintf("%q refers to no metric", expr))
	}
	for name, labels := range refs {
		have, ok := series[name]
		if !ok {
			bad = append(bad, fmt.Sprintf("metric %s is not exported by qemu-kubelet or exporterset-controller", name))
			continue
		}
		for _, l := range labels {
			if !slices.Contains(have, l) && !slices.Contains(targetLabels, l) {
				bad = append(bad, fmt.Sprintf("metric %s has no label %s (labels: %v)", name, l, have))
			}
		}
	}
	slices.Sort(bad)
	return bad
}

// dashboardQueries returns every PromQL expression of a Grafana dashboard:
// the panels' targets (rows' nested panels too) and the query variables.
func dashboardQueries(t *testing.T, dash map[string]any) map[string]string {
	t.Helper()
	out := map[string]string{}
	var walk func(panels []any)
	walk = func(panels []any) {
		for _, p := range panels {
			pm := p.(map[string]any)
			if nested, ok := pm["panels"].([]any); ok {
				walk(nested)
			}
			targets, _ := pm["targets"].([]any)
			for _, tg := range targets {
				tm := tg.(map[string]any)
				out[fmt.Sprintf("panel %q target %s", pm["title"], tm["refId"])] = tm["expr"].(string)
			}
		}
	}
	walk(dash["panels"].([]any))
	tmpl := dash["templating"].(map[string]any)["list"].([]any)
	labelValues := regexp.MustCompile(`^label_values\((.*),\s*([a-zA-Z_][a-zA-Z0-9_]*)\)$`)
	for _, v := range tmpl {
		vm := v.(map[string]any)
		if vm["type"] != "query" {
			continue
		}
		q := vm["query"].(map[string]any)["query"].(string)
		m := labelValues.FindStringSubmatch(q)
		require.NotNil(t, m, "variable %s: only label_values(metric, label) queries are checked: %q", vm["name"], q)
		// The label the variable lists must be selectable on the metric.
		out[fmt.Sprintf("variable %s", vm["name"])] = fmt.Sprintf(`%s{%s=""}`, strings.TrimSuffix(m[1], "}"), m[2])
		if strings.Contains(m[1], "{") {
			out[fmt.Sprintf("variable %s", vm["name"])] = fmt.Sprintf(`%s,%s=""}`, strings.TrimSuffix(m[1], "}"), m[2])
		}
	}
	return out
}

// TestDashboardMetricsExported: every metric (and selector label) the
// Grafana dashboard's queries use is one the binaries export, as their
// registration code registers it.
func TestDashboardMetricsExported(t *testing.T) {
	series := exported(t)
	// The inventory itself: derived, not listed; spot-check its shape.
	require.Contains(t, series, telemetry.MetricVMStartDuration+"_bucket", "a histogram has buckets")
	require.NotContains(t, series, telemetry.MetricVMStartDuration, "a histogram has no bare series")
	require.Contains(t, series, "process_resident_memory_bytes", "the agent's process collector")
	require.Contains(t, series, telemetry.MetricImageCacheSize, "the scrape-time state collector")

	b, err := os.ReadFile(dashboardFile)
	require.NoError(t, err)
	var dash map[string]any
	require.NoError(t, json.Unmarshal(b, &dash))
	queries := dashboardQueries(t, dash)
	require.GreaterOrEqual(t, len(queries), 15, "the dashboard's queries")
	used := map[string]bool{}
	for where, q := range queries {
		assert.Empty(t, checkQuery(q, series), "%s: %s", where, q)
		refs, _ := promqlRefs(q)
		for m := range refs {
			used[m] = true
		}
	}
	// Every qemu_kubelet family has a panel.
	for name := range series {
		base := strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(name, "_bucket"), "_sum"), "_count")
		if !strings.HasPrefix(name, "qemu_kubelet_") || used[name] || used[base+"_bucket"] || used[base+"_sum"] {
			continue
		}
		if _, hist := series[base+"_bucket"]; hist && base != name {
			continue // the family is checked under its _bucket name
		}
		t.Errorf("metric %s has no panel in the dashboard", name)
	}
}

// TestDashboardCheckCatchesMistakes: the check fails a query on a metric
// or label no binary exports, a histogram queried without its suffix, and
// a query with no metric at all.
func TestDashboardCheckCatchesMistakes(t *testing.T) {
	series := exported(t)
	for expr, want := range map[string]string{
		`rate(qemu_kubelet_vm_start_total[5m])`:                                      "metric qemu_kubelet_vm_start_total is not exported",
		`histogram_quantile(0.9, rate(qemu_kubelet_vm_start_duration_seconds[5m]))`:  "metric qemu_kubelet_vm_start_duration_seconds is not exported",
		`qemu_kubelet_exporterset_replicas{set="a"}`:                                 "metric qemu_kubelet_exporterset_replicas has no label set",
		`sum by (x) (rate(qemu_kubelet_vms_running_total[1m])) and on (instance) up`: "metric up is not exported",
		`1 + 1`: "refers to no metric",
	} {
		bad := checkQuery(expr, series)
		assert.NotEmpty(t, bad, expr)
		assert.True(t, slices.ContainsFunc(bad, func(s string) bool { return strings.Contains(s, want) }), "%s: %v", expr, bad)
	}
	for _, ok := range []string{
		`sum by (le, result) (rate(qemu_kubelet_image_pull_duration_seconds_bucket{instance=~"$instance"}[$__rate_interval]))`,
		`qemu_kubelet_exporterset_available_replicas{namespace=~"$namespace",exporterset=~"a|b"} / clamp_min(qemu_kubelet_exporterset_desired_replicas, 1)`,
		`process_resident_memory_bytes and on (instance) qemu_kubelet_vms_running`,
	} {
		assert.Empty(t, checkQuery(ok, series), ok)
	}
}

// TestGrafanaDashboardConfigMap: monitoring.grafanaDashboard renders a
// ConfigMap with the sidecar's label holding the dashboard file as is; it
// is off by default.
func TestGrafanaDashboardConfigMap(t *testing.T) {
	isDash := func(o unstructured.Unstructured) bool {
		return o.GetKind() == "ConfigMap" && strings.HasSuffix(o.GetName(), "-dashboard")
	}
	assert.False(t, slices.ContainsFunc(objects(t, render(t, "")), isDash), "off by default")

	objs := objects(t, render(t, chartDir+"/ci/monitoring-values.yaml", "monitoring.grafanaDashboard.namespace=monitoring"))
	i := slices.IndexFunc(objs, isDash)
	require.GreaterOrEqual(t, i, 0, "dashboard ConfigMap rendered")
	cm := one[corev1.ConfigMap](t, []unstructured.Unstructured{objs[i]}, "ConfigMap")
	assert.Equal(t, "1", cm.Labels["grafana_dashboard"], "Grafana sidecar label")
	assert.Equal(t, "qemu-kubelet", cm.Annotations["grafana_folder"])
	assert.Equal(t, "monitoring", cm.Namespace)
	want, err := os.ReadFile(dashboardFile)
	require.NoError(t, err)
	assert.JSONEq(t, string(want), cm.Data["qemu-kubelet.json"], "the file as is")
	var dash map[string]any
	require.NoError(t, json.Unmarshal([]byte(cm.Data["qemu-kubelet.json"]), &dash))
	assert.Equal(t, "qemu-kubelet", dash["uid"])

	_, stderr, err := runHelm(t, templateArgs("", "monitoring.grafanaDashboard.enabled=yes")...)
	require.Error(t, err, "the schema refuses a non-boolean")
	assert.Contains(t, stderr, "grafanaDashboard")
}
