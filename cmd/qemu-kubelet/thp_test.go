package main

import (
	"context"
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/qemu-kubelet/qemu-kubelet/provider"
	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"github.com/qemu-kubelet/qemu-kubelet/provider/nodestatus"
)

// TestApplyTHP: the agent's start sets the process's transparent huge
// pages flag from the setting and its nodes' probed accelerators, and the
// processes it starts afterwards (its QEMUs; here cat) inherit it.
func TestApplyTHP(t *testing.T) {
	t.Cleanup(func() { _ = provider.SetProcessTHP(false) })
	node := func(accel string) nodestatus.Facts {
		return nodestatus.Facts{Accelerator: nodestatus.Accelerator{Name: accel}}
	}
	for _, tt := range []struct {
		setting string
		facts   []nodestatus.Facts
		want    string // the child's THP_enabled
	}{
		{config.THPAuto, []nodestatus.Facts{node("tcg")}, "0"},
		{config.THPAuto, []nodestatus.Facts{node("kvm"), node("tcg")}, "1"},
		{config.THPAuto, []nodestatus.Facts{node("")}, "1"},
		{config.THPDisabled, []nodestatus.Facts{node("kvm")}, "0"},
		{config.THPEnabled, []nodestatus.Facts{node("tcg")}, "1"},
	} {
		require.NoError(t, applyTHP(context.Background(), tt.setting, tt.facts))
		out, err := exec.Command("cat", "/proc/self/status").Output()
		require.NoError(t, err)
		var got string
		for _, l := range strings.Split(string(out), "\n") {
			if v, ok := strings.CutPrefix(l, "THP_enabled:"); ok {
				got = strings.TrimSpace(v)
			}
		}
		var accels []string
		for _, f := range tt.facts {
			accels = append(accels, f.Accelerator.Name)
		}
		assert.Equal(t, tt.want, got, "%s, accelerators %q: the child's THP_enabled", tt.setting, accels)
	}
}
