package config

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func resolveYAML(t *testing.T, body string) (*Node, error) {
	t.Helper()
	c, err := Decode([]byte(header + body))
	if err != nil {
		return nil, err
	}
	return Resolve(c, env)
}

func TestFeatureGatesMatchConstants(t *testing.T) {
	var names []string
	defaults := map[string]bool{}
	for _, g := range FeatureGates {
		names = append(names, g.Name)
		defaults[g.Name] = g.Default
	}
	assert.Equal(t, []string{FeatureUEFI, FeaturePortForward, FeatureAttach, FeatureJumpstarterExporter}, names)
	// Today's behaviour: everything on.
	assert.Equal(t, map[string]bool{FeatureUEFI: true, FeaturePortForward: true, FeatureAttach: true, FeatureJumpstarterExporter: true}, defaults)
}

func TestResolveFeatures(t *testing.T) {
	all := func(uefi, pf, attach, js bool) map[string]bool {
		return map[string]bool{FeatureUEFI: uefi, FeaturePortForward: pf, FeatureAttach: attach, FeatureJumpstarterExporter: js}
	}
	tests := []struct {
		name     string
		in       string
		gates    map[string]bool
		console  int64
		annot    string
		wantErrs []string
	}{
		{name: "absent: today's behaviour", in: "", gates: all(true, true, true, true), console: 8 << 20,
			annot: "attach=true,jumpstarterExporter=true,portForward=true,uefi=true,consoleLogSize=8Mi"},
		{name: "empty section", in: "features: {}\n", gates: all(true, true, true, true), console: 8 << 20},
		{name: "some off", in: "features: {uefi: false, attach: false, consoleLogSize: 1Mi}\n", gates: all(false, true, false, true), console: 1 << 20,
			annot: "attach=false,jumpstarterExporter=true,portForward=true,uefi=false,consoleLogSize=1Mi"},
		{name: "console number", in: "features: {consoleLogSize: 65536}\n", gates: all(true, true, true, true), console: 64 << 10},
		{name: "unknown feature", in: "features: {snapshotStart: true}\n", wantErrs: []string{`unknown field "features.snapshotStart"`}},
		{name: "not a bool", in: "features: {uefi: maybe}\n", wantErrs: []string{"features.uefi"}},
		{name: "console too small", in: "features: {consoleLogSize: 1Ki}\n", wantErrs: []string{"features.consoleLogSize", "at least 64Ki"}},
		{name: "console not a quantity", in: "features: {consoleLogSize: lots}\n", wantErrs: []string{"features.consoleLogSize", "quantity"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			n, err := resolveYAML(t, tt.in)
			if len(tt.wantErrs) > 0 {
				require.Error(t, err)
				for _, w := range tt.wantErrs {
					assert.Contains(t, err.Error(), w)
				}
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.gates, n.Features.Gates)
			assert.Equal(t, tt.console, n.Features.ConsoleLogSize)
			if tt.annot != "" {
				assert.Equal(t, tt.annot, n.Features.String())
			}
			for name, on := range tt.gates {
				assert.Equal(t, on, n.Features.Enabled(name), name)
			}
			assert.False(t, n.Features.Enabled("nosuch"))
		})
	}
}

func TestDefaultFeatures(t *testing.T) {
	n, err := resolveYAML(t, "")
	require.NoError(t, err)
	assert.Equal(t, n.Features, DefaultFeatures())
	var nilFC *FeatureConfig
	assert.True(t, nilFC.Enabled(FeatureUEFI), "nil: the defaults")
}

func TestPlanReload(t *testing.T) {
	const base = "nodeName: n1\nstateDir: /var/lib/qk\nmaxVMs: 4\n"
	tests := []struct {
		name    string
		next    string
		current string // features in force ("": the started file's)
		changes []string
		restart []string
	}{
		{name: "same file", next: base},
		{name: "feature on", next: base + "features: {uefi: true}\n", current: "features: {uefi: false}\n", changes: []string{"uefi: false -> true"}},
		{name: "features off and console", next: base + "features: {attach: false, portForward: false, consoleLogSize: 1Mi}\n",
			changes: []string{"attach: true -> false", "portForward: true -> false", "consoleLogSize: 8Mi -> 1Mi"}},
		{name: "explicit defaults are no change", next: base + "features: {uefi: true, consoleLogSize: 8Mi}\n"},
		{name: "restart-only fields", next: "nodeName: n2\nstateDir: /srv/qk\nmaxVMs: 4\nreserved: {memory: 1Gi}\n", restart: []string{"nodeName", "stateDir", "reserved"}},
		{name: "both", next: base + "guestArchitectures: [{arch: arm64}]\nfeatures: {jumpstarterExporter: false}\n",
			changes: []string{"jumpstarterExporter: true -> false"}, restart: []string{"guestArchitectures"}},
		{name: "a field set to its default is no change", next: base + "accelerator: {policy: prefer-kvm}\n"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			started, err := resolveYAML(t, base)
			require.NoError(t, err)
			current := started.Features
			if tt.current != "" {
				c, err := resolveYAML(t, base+tt.current)
				require.NoError(t, err)
				current = c.Features
			}
			next, err := resolveYAML(t, tt.next)
			require.NoError(t, err)
			plan := PlanReload(started, current, next)
			var changes []string
			for _, c := range plan.Changes {
				changes = append(changes, c.String())
			}
			assert.Equal(t, tt.changes, changes)
			assert.Equal(t, tt.restart, plan.RestartRequired)
			if len(tt.changes) == 0 {
				assert.Same(t, current, plan.Features, "no feature changed: those in force stay")
			} else {
				assert.Same(t, next.Features, plan.Features)
			}
		})
	}
}
