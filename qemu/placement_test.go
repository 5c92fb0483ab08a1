package qemu

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestCPUShares(t *testing.T) {
	for w, want := range map[int]int{100: 1024, 50: 512, 1: 10, 10000: 102400} {
		assert.Equal(t, want, cpuShares(w), "weight %d", w)
	}
}

func TestPlanCPUPlacement(t *testing.T) {
	base := Cgroup{Root: "/sys/fs/cgroup", Parent: "qemu-kubelet"}
	for _, tc := range []struct {
		name string
		in   PlacementInput
		want CPUPlacement // Why is checked for wantWhy only
		why  string
	}{
		{"inherit, agent in the root CPU cgroup: CPU-only cgroup, no nice",
			PlacementInput{Base: base, Weight: 50, Nice: 10, AgentCPUCgroup: "/"},
			CPUPlacement{Cgroup: &Cgroup{Root: "/sys/fs/cgroup", Parent: "qemu-kubelet", CPUOnly: true, ParentCPUWeight: 50}},
			"CPU weight 50"},
		{"inherit, agent in a cgroup of its own: nice, VMs stay with the agent",
			PlacementInput{Base: base, Weight: 50, Nice: 10, AgentCPUCgroup: "/system.slice/qemu-kubelet.service"},
			CPUPlacement{Nice: 10},
			"/system.slice/qemu-kubelet.service"},
		{"inherit, agent's cgroup unknown: nice",
			PlacementInput{Base: base, Weight: 50, Nice: 10, AgentErr: errors.New("no /proc")},
			CPUPlacement{Nice: 10},
			"no /proc"},
		{"inherit, weight 0: nice",
			PlacementInput{Base: base, Weight: 0, Nice: 7, AgentCPUCgroup: "/"},
			CPUPlacement{Nice: 7},
			"cpuWeight 0"},
		{"own: the parent weighs, no nice",
			PlacementInput{Base: base, Own: true, Weight: 200, Nice: 10},
			CPUPlacement{Cgroup: &Cgroup{Root: "/sys/fs/cgroup", Parent: "qemu-kubelet", ParentCPUWeight: 200}},
			"CPU weight 200"},
		{"own, weight 0: its cgroups and nice",
			PlacementInput{Base: base, Own: true, Weight: 0, Nice: 10},
			CPUPlacement{Cgroup: &base, Nice: 10},
			"nice 10"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := PlanCPUPlacement(tc.in)
			assert.Contains(t, got.Why, tc.why)
			got.Why = ""
			assert.Equal(t, tc.want, got)
		})
	}
}

func TestCPUPlacementFallback(t *testing.T) {
	base := Cgroup{Root: "/sys/fs/cgroup", Parent: "qemu-kubelet"}
	in := PlacementInput{Base: base, Weight: 50, Nice: 10, AgentCPUCgroup: "/"}
	fb := PlanCPUPlacement(in).Fallback(in, os.ErrPermission)
	assert.Nil(t, fb.Cgroup, "mode Inherit: the VMs stay in the agent's cgroup")
	assert.Equal(t, 10, fb.Nice)
	assert.Contains(t, fb.Why, "permission denied")
	assert.Contains(t, fb.Why, "nice 10")

	in.Own = true
	fb = PlanCPUPlacement(in).Fallback(in, os.ErrPermission)
	require.NotNil(t, fb.Cgroup, "mode Own keeps each VM's cgroup")
	assert.Equal(t, base, *fb.Cgroup, "without a weight")
	assert.Equal(t, 10, fb.Nice)
}

// TestCPUOnlyCgroup: a process placed by a CPU-only cgroup (as a VM of a
// node in mode Inherit whose agent runs in the root CPU cgroup) is in the
// VM's cgroup of the cpu hierarchy only and in its launcher's cgroup of
// every other; the parent carries the weight; removal leaves no cgroup.
// Real cgroups: needs root.
func TestCPUOnlyCgroup(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (CAP_DAC_OVERRIDE at the cgroup root): creates cgroups")
	}
	parent := fmt.Sprintf("qk-cpuonly-test-%d", os.Getpid())
	c := Cgroup{Root: DefaultCgroupRoot, Parent: parent, CPUOnly: true, ParentCPUWeight: 50}
	t.Cleanup(func() { // in every hierarchy: whatever a failure left
		all, _ := cgroupDirs(DefaultCgroupRoot, parent)
		for _, d := range all {
			sub, _ := filepath.Glob(filepath.Join(d.path, "*", "cgroup.procs"))
			for _, p := range sub {
				_ = syscall.Rmdir(filepath.Dir(p))
			}
			_ = syscall.Rmdir(d.path)
		}
	})
	require.NoError(t, PrepareCgroupParent(c), "prepare the VMs' parent")
	pdirs, err := c.dirs(parent)
	require.NoError(t, err)
	require.Len(t, pdirs, 1, "one hierarchy: the cpu controller's")
	weightFile, weight, dflt := "cpu.shares", "512", "1024"
	if pdirs[0].v2 {
		weightFile, weight, dflt = "cpu.weight", "50", "100"
	}
	assertCgroupFile(t, pdirs[0].path, weightFile, weight)
	// Put back the default: each VM's start sets the weight again.
	require.NoError(t, os.WriteFile(filepath.Join(pdirs[0].path, weightFile), []byte(dflt), 0))

	sleep := exec.Command("sleep", "60")
	require.NoError(t, sleep.Start())
	t.Cleanup(func() { _ = sleep.Process.Kill(); _ = sleep.Wait() })
	before, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", sleep.Process.Pid))
	require.NoError(t, err)

	spec := Spec{Name: "cpuonly", StateDir: filepath.Join(t.TempDir(), "vm-cpuonly"), Cgroup: &c}
	dirs, err := prepareCgroup(spec)
	require.NoError(t, err)
	require.NoError(t, moveToCgroup(dirs, sleep.Process.Pid))
	after, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", sleep.Process.Pid))
	require.NoError(t, err)
	want := "/" + parent + "/vm-cpuonly"
	cpuCg, err := AgentCPUCgroupOf(DefaultCgroupRoot, sleep.Process.Pid)
	require.NoError(t, err)
	assert.Equal(t, want, cpuCg, "in the VM's cgroup of the cpu hierarchy")
	if !pdirs[0].v2 {
		moved := 0
		for i, l := range strings.Split(strings.TrimSpace(string(after)), "\n") {
			old := strings.Split(strings.TrimSpace(string(before)), "\n")[i]
			if l != old {
				moved++
				assert.True(t, strings.HasSuffix(l, ":"+want), "only the cpu hierarchy changes: %q (was %q)", l, old)
			}
		}
		assert.Equal(t, 1, moved, "cgroups before %q, after %q", before, after)
	}
	assertCgroupFile(t, pdirs[0].path, weightFile, weight)

	// Out again (the process ends in the real VM's case), then removed.
	require.NoError(t, os.WriteFile(filepath.Join(filepath.Dir(pdirs[0].path), "cgroup.procs"), []byte(strconv.Itoa(sleep.Process.Pid)), 0))
	require.NoError(t, removeCgroup(spec))
	_, err = os.Stat(dirs[0].path)
	assert.True(t, os.IsNotExist(err), "VM cgroup %s removed: %v", dirs[0].path, err)
}
