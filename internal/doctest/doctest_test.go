package doctest

import (
	"flag"
	"fmt"
	"go/parser"
	"go/token"
	"slices"
	"strings"
	"testing"
)

const sample = "# Tool\n\n" +
	"## Flags\n\n" +
	"| Flag | Default | Meaning |\n" +
	"|------|---------|---------|\n" +
	"| `--config` | `\"\"` | the file |\n" +
	"| `--kube-api-qps` | `50` | QPS (`a\\|b` stays one cell) |\n" +
	"| `-v N` | `0` | klog |\n\n" +
	"```sh\n# not a heading\n| not | a table |\n```\n\n" +
	"## Flags\n\nagain: [x](#flags-1), [y](other.md#some-thing), [z](#missing), `[no](link.md)`\n"

func TestSectionAndTable(t *testing.T) {
	d := Parse("docs/tool.md", sample)
	if got := d.Headings(); strings.Join(got, ",") != "Tool,Flags,Flags" {
		t.Fatalf("headings %q: a # line inside a code block is no heading", got)
	}
	s, err := d.Section("Flags")
	if err != nil {
		t.Fatal(err)
	}
	if len(s.Tables()) != 1 {
		t.Fatalf("want the one table of the first Flags section, got %d", len(s.Tables()))
	}
	tab, err := s.Table("Flag")
	if err != nil {
		t.Fatal(err)
	}
	if len(tab.Rows) != 3 || tab.Lines[0] != 7 {
		t.Fatalf("rows %q at lines %v", tab.Rows, tab.Lines)
	}
	if got := tab.Rows[1][2]; got != "QPS (`a|b` stays one cell)" {
		t.Errorf("cell %q", got)
	}
	if _, err := d.Section("Nope"); err == nil {
		t.Error("a missing section is an error")
	}
	if _, err := s.Table("Value"); err == nil {
		t.Error("a missing table is an error")
	}
}

func flagSet() *flag.FlagSet {
	fs := flag.NewFlagSet("tool", flag.ContinueOnError)
	fs.String("config", "", "the file")
	fs.Int("kube-api-qps", 50, "QPS")
	fs.Int("v", 0, "klog")
	fs.Int("logtostderr", 0, "klog, not documented")
	return fs
}

func TestFlagTableMatches(t *testing.T) {
	d := Parse("docs/tool.md", sample)
	s, _ := d.Section("Flags")
	tab, _ := s.Table("Flag")
	errs := FlagTableErrors(tab, flagSet(), func(n string) bool { return n == "logtostderr" })
	if len(errs) != 0 {
		t.Fatalf("a table that matches: %q", errs)
	}
}

// TestFlagTableStale: a table that misses a flag, names one that does not
// exist, or states a wrong default fails, each with a message naming it.
func TestFlagTableStale(t *testing.T) {
	stale := strings.NewReplacer("| `--kube-api-qps` | `50` |", "| `--kube-api-qps` | `100` |",
		"| `--config` | `\"\"` | the file |\n", "| `--node-name` | `\"\"` | gone |\n").Replace(sample)
	d := Parse("docs/tool.md", stale)
	s, _ := d.Section("Flags")
	tab, _ := s.Table("Flag")
	errs := strings.Join(FlagTableErrors(tab, flagSet(), func(n string) bool { return n == "logtostderr" }), "\n")
	for _, want := range []string{
		"documented flag -node-name does not exist",
		"-kube-api-qps: documented default `100`, the flag's is `50`",
		"flag -config (\"the file\", default \"\") has no row",
	} {
		if !strings.Contains(errs, want) {
			t.Errorf("errors %q\nlack %q", errs, want)
		}
	}
	if strings.Contains(errs, "logtostderr") {
		t.Errorf("an undocumented flag that may be undocumented is reported: %s", errs)
	}
	bad := tab
	bad.Header = []string{"Flag", "Meaning"}
	if errs := FlagTableErrors(bad, flagSet(), nil); len(errs) != 1 || !strings.Contains(errs[0], "want columns Flag, Default") {
		t.Errorf("a table without a Default column: %q", errs)
	}
}

func TestFlagName(t *testing.T) {
	for in, want := range map[string]string{"--node-name": "node-name", "-v N": "v", "--config=FILE": "config", "config": "", "--a b": "a"} {
		if got := FlagName(in); got != want {
			t.Errorf("FlagName(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestSlug(t *testing.T) {
	for in, want := range map[string]string{
		"Configuration into the guest (`provider/volumes.go`)": "configuration-into-the-guest-providervolumesgo",
		"Several nodes: spread, drain, node loss":              "several-nodes-spread-drain-node-loss",
		"Agent restarts and VMs":                               "agent-restarts-and-vms",
		"`kubectl logs` = the serial console":                  "kubectl-logs--the-serial-console",
	} {
		if got := Slug(in); got != want {
			t.Errorf("Slug(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestLinkErrors(t *testing.T) {
	docs := map[string]*Doc{
		"docs/tool.md":  Parse("docs/tool.md", sample),
		"docs/other.md": Parse("docs/other.md", "# Other\n\n## Some thing\n\n[back](tool.md) [gone](gone.md) [img](pic.png) [web](https://x.example/#a)\n"),
	}
	exists := func(rel string) bool { return rel == "docs/tool.md" || rel == "docs/other.md" || rel == "docs/pic.png" }
	errs := strings.Join(LinkErrors(docs, exists), "\n")
	for _, want := range []string{
		"docs/tool.md:18: link #missing: docs/tool.md has no heading with anchor #missing",
		"docs/other.md:5: link gone.md: no file docs/gone.md",
	} {
		if !strings.Contains(errs, want) {
			t.Errorf("errors %q\nlack %q", errs, want)
		}
	}
	if n := strings.Count(errs, "\n") + 1; n != 2 {
		t.Errorf("want exactly 2 errors (#flags-1, other.md#some-thing, the image and the web link are fine), got %d: %s", n, errs)
	}
}

const symbolSrc = `package telemetry

type Metrics struct{ JSStreams int }

func (m *Metrics) Registration(err error) {}

func RegisterMetrics() {}

type Pods interface{ RunningVMs() int }

var descVMs = 1
`

func symbols(t *testing.T) Symbols {
	t.Helper()
	f, err := parser.ParseFile(token.NewFileSet(), "metrics.go", symbolSrc, 0)
	if err != nil {
		t.Fatal(err)
	}
	s := Symbols{}
	s.add(f)
	return s
}

// TestSymbolErrors: a renamed or moved function, a missing method or
// field, and a method of a type named without its package fail with the
// doc's line; spans of other packages, calls, pointers and variables'
// paths are read as the code has them.
func TestSymbolErrors(t *testing.T) {
	doc := Parse("docs/o.md", "# O\n\n"+
		"`telemetry.RegisterMetrics` `*telemetry.Metrics` `telemetry.Metrics.Registration(err)` `telemetry.Pods.RunningVMs`\n"+
		"`corev1.Pod` `Metrics.JSStreams` `(*Metrics).Registration` `QemuClient.flash_oci` `telemetry.descVMs`\n"+
		"`provider.RegisterMetrics` `telemetry.NewMetricz()` `telemetry.Metrics.Observe` `Metrics.Gone`\n"+
		"```go\ntelemetry.Nothing()\n```\n")
	s := symbols(t)
	s["provider"] = map[string]bool{"NewVMs": true}
	errs := SymbolErrors(map[string]*Doc{"docs/o.md": doc}, s)
	want := []string{
		"docs/o.md:5: `provider.RegisterMetrics`: no package provider of the module declares RegisterMetrics (declared in package telemetry)",
		"docs/o.md:5: `telemetry.NewMetricz`: no package telemetry of the module declares NewMetricz",
		"docs/o.md:5: `telemetry.Metrics.Observe`: telemetry.Metrics has no field or method Observe",
		"docs/o.md:5: `Metrics.Gone`: no type Metrics of the module has a field or method Gone",
	}
	if strings.Join(errs, "\n") != strings.Join(want, "\n") {
		t.Errorf("errors\n%s\nwant\n%s", strings.Join(errs, "\n"), strings.Join(want, "\n"))
	}
}

func TestParseLabels(t *testing.T) {
	for cell, want := range map[string]string{
		"`result` (`success`, `error`)":                                 "result[success error]",
		"`result`: `success`, `no_exporter`":                            "result[success no_exporter]",
		"`driver` (`root`, `power`, ...), `method`, `code` (`OK`, ...)": "driver[root power]... method[] code[OK]...",
		"`controller=\"exporterset\"`, `name`, `priority`":              "controller[exporterset]... name[] priority[]",
		"`namespace`, `exporterset`":                                    "namespace[] exporterset[]",
		"":                                                              "",
		"`kind` (`console`, `tcp`, `vnc`, `resource`: a file flashed)": "kind[console tcp vnc resource]",
	} {
		var got []string
		for _, l := range ParseLabels(cell) {
			s := fmt.Sprintf("%s%v", l.Name, l.Values)
			if l.Values == nil {
				s = l.Name + "[]"
			}
			if l.Open {
				s += "..."
			}
			got = append(got, s)
		}
		if g := strings.Join(got, " "); g != want {
			t.Errorf("ParseLabels(%q) = %q, want %q", cell, g, want)
		}
	}
}

// TestMetricTableErrors: a metric the binaries do not register, a wrong
// type, a missing, extra or renamed label, a label value the code cannot
// give and a closed value list missing an exported value each fail with
// the doc's line; a family known by name only is checked by name.
func TestMetricTableErrors(t *testing.T) {
	fams := map[string]*Family{
		"qk_streams":          {Type: "gauge", Labels: []string{"kind"}},
		"qk_pulls":            {Type: "counter", Labels: []string{"result"}, Values: map[string][]string{"result": {"success", "not_found"}}},
		"qk_calls":            {Type: "counter", Labels: []string{"driver", "code"}},
		"dep_reconcile_total": {},
	}
	lookup := func(n string) (*Family, bool) { f, ok := fams[n]; return f, ok }
	known := func(v string) bool { return v == "console" || v == "tcp" || v == "error" || v == "root" }
	doc := Parse("docs/m.md", "# M\n\n| Metric | Type | Labels | Meaning |\n|---|---|---|---|\n"+
		"| `qk_streams` | gauge | `kind` (`console`, `tcp`) | ok |\n"+
		"| `qk_pulls` | counter | `result` (`success`, `not_found`, `error`) | ok |\n"+
		"| `qk_calls` | counter | `driver` (`root`, ...), `code` | ok |\n"+
		"| `dep_reconcile_total` | counter | `controller`, `result` (`whatever`) | by name only |\n"+
		"| `qk_streams` | counter | `kinds` (`console`) | wrong type, renamed label |\n"+
		"| `qk_pulls` | counter | `result` (`success`, `unauthorised`) | a value the code cannot give, a closed list without not_found |\n"+
		"| `qk_calls` | counter | `driver` | a label missing |\n"+
		"| `qk_gone_total` | counter | | not registered |\n")
	tab, err := doc.Table("Metric")
	if err != nil {
		t.Fatal(err)
	}
	errs, names := MetricTableErrors(doc.Path, tab, lookup, known)
	want := []string{
		"docs/m.md:9: metric qk_streams documented as counter, registered as a gauge",
		"docs/m.md:9: metric qk_streams documented with labels [\"kinds\"], registered with [\"kind\"]",
		"docs/m.md:10: metric qk_pulls: label result value \"unauthorised\" is neither exported from the start nor a string the code holds",
		"docs/m.md:10: metric qk_pulls: label result value \"not_found\" is exported but not in the documented list [\"success\" \"unauthorised\"] (end it with ... if it is not the whole set)",
		"docs/m.md:11: metric qk_calls documented with labels [\"driver\"], registered with [\"code\" \"driver\"]",
		"docs/m.md:12: metric qk_gone_total is not registered by the binaries",
	}
	if strings.Join(errs, "\n") != strings.Join(want, "\n") {
		t.Errorf("errors\n%s\nwant\n%s", strings.Join(errs, "\n"), strings.Join(want, "\n"))
	}
	if len(names) != 8 {
		t.Errorf("documented names %q", names)
	}
	bad := tab
	bad.Header = []string{"Metric", "Meaning"}
	if errs, _ := MetricTableErrors("docs/m.md", bad, lookup, known); len(errs) != 1 || !strings.Contains(errs[0], "want columns Metric, [Type,] Labels") {
		t.Errorf("a table without a Labels column: %q", errs)
	}
}

// TestRBACErrors: a verb the chart does not grant, a grant no row names
// and a row whose When does not hold fail or are skipped as they should;
// a malformed table is reported.
func TestRBACErrors(t *testing.T) {
	doc := Parse("docs/i.md", "# I\n\n| Subject | Scope | API group | Resources | Verbs | When | Why |\n|---|---|---|---|---|---|---|\n"+
		"| controller | cluster | `jumpstarter.dev` | `leases` | get, list, watch, update | | read |\n"+
		"| node agent | cluster | core | `secrets`, `configmaps` | get | `nodeAgent.read=true` | |\n"+
		"| node agent | `kube-node-lease` | `coordination.k8s.io` | `leases` | get | | |\n")
	tab, err := doc.Table("Subject")
	if err != nil {
		t.Fatal(err)
	}
	rows, errs := RBACRows(doc.Path, tab)
	if len(errs) != 0 || len(rows) != 3 || len(rows[0].Grants) != 4 || rows[1].When["nodeAgent.read"] != "true" || rows[2].Grants[0].Scope != "kube-node-lease" {
		t.Fatalf("rows %+v, errors %q", rows, errs)
	}
	rendered := []Grant{
		{"controller", "cluster", "jumpstarter.dev", "leases", "get"},
		{"controller", "cluster", "jumpstarter.dev", "leases", "list"},
		{"controller", "cluster", "jumpstarter.dev", "leases", "watch"},
		{"node agent", "kube-node-lease", "coordination.k8s.io", "leases", "get"},
		{"node agent", "kube-node-lease", "coordination.k8s.io", "leases", "create"},
	}
	always := func(when map[string]string) bool { return len(when) == 0 }
	got := RBACErrors(doc.Path, rows, always, rendered, "default values")
	want := []string{
		"docs/i.md: the chart (default values) grants node agent: create coordination.k8s.io/leases (kube-node-lease), which no row of the RBAC table says",
		"docs/i.md:5: documents controller: update jumpstarter.dev/leases (cluster), which the chart (default values) does not grant",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("errors\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	// With its When holding, the secrets row must be rendered too.
	got = RBACErrors(doc.Path, rows, func(map[string]string) bool { return true }, rendered, "--set nodeAgent.read=true")
	if !slices.ContainsFunc(got, func(e string) bool { return strings.Contains(e, "node agent: get core/configmaps (cluster)") }) {
		t.Errorf("a row whose When holds is not checked: %q", got)
	}
	bad := tab
	bad.Header = []string{"Subject", "Grants"}
	if _, errs := RBACRows(doc.Path, bad); len(errs) != 1 {
		t.Errorf("a table without the columns: %q", errs)
	}
}
