package provider

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
)

// TestDecideTHP: vmMemory.transparentHugePages against the accelerators
// of the process's nodes.
func TestDecideTHP(t *testing.T) {
	tcg, kvm := qemu.AccelTCG, qemu.AccelKVM
	tests := []struct {
		setting string
		accels  []qemu.Accelerator
		disable bool
		why     string
	}{
		{config.THPAuto, []qemu.Accelerator{tcg}, true, "TCG"},
		{config.THPAuto, []qemu.Accelerator{kvm}, false, "KVM"},
		// A KVM main node with a guest-architecture node (always TCG):
		// the flag is process wide, the KVM guests keep huge pages.
		{config.THPAuto, []qemu.Accelerator{kvm, tcg}, false, "KVM"},
		{config.THPAuto, []qemu.Accelerator{tcg, tcg}, true, "TCG"},
		// A node whose probe failed starts no VM: it decides nothing.
		{config.THPAuto, []qemu.Accelerator{"", tcg}, true, "TCG"},
		{config.THPAuto, []qemu.Accelerator{""}, false, "no accelerator"},
		{config.THPAuto, nil, false, "no accelerator"},
		{config.THPEnabled, []qemu.Accelerator{tcg}, false, "Enabled"},
		{config.THPEnabled, []qemu.Accelerator{kvm}, false, "Enabled"},
		{config.THPDisabled, []qemu.Accelerator{kvm}, true, "Disabled"},
		{config.THPDisabled, []qemu.Accelerator{tcg}, true, "Disabled"},
	}
	for _, tt := range tests {
		d := DecideTHP(tt.setting, tt.accels)
		assert.Equal(t, tt.disable, d.Disable, "%s %v: %s", tt.setting, tt.accels, d.Why)
		assert.Contains(t, d.Why, tt.why, "%s %v", tt.setting, tt.accels)
	}
}

// thpChildEnv switches the test binary into thpChild (TestMain): its
// value is the vmMemory.transparentHugePages setting to apply.
const thpChildEnv = "QK_TEST_THP_CHILD"

// thpChild is the test binary re-executed by TestSetProcessTHPInherited:
// it applies setting as the agent does on a TCG node (DecideTHP,
// SetProcessTHP), starts a sleep, writes its PID on stdout and waits for
// its stdin to close.
func thpChild(setting string) int {
	if err := SetProcessTHP(DecideTHP(setting, []qemu.Accelerator{qemu.AccelTCG}).Disable); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	sleep := exec.Command("sleep", "300")
	if err := sleep.Start(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer func() { _ = sleep.Process.Kill(); _ = sleep.Wait() }()
	fmt.Println(sleep.Process.Pid)
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n') // until the parent closes it
	return 0
}

// TestSetProcessTHPInherited: a process that applied the node's decision
// starts its children without transparent huge pages (THP_enabled 0 in
// their /proc/PID/status) under Auto on a TCG node and Disabled, and with
// them (1) under Enabled: the test binary re-executed as the agent, a
// sleep as its QEMU.
func TestSetProcessTHPInherited(t *testing.T) {
	for setting, want := range map[string]bool{config.THPAuto: false, config.THPDisabled: false, config.THPEnabled: true} {
		t.Run(setting, func(t *testing.T) {
			child := exec.Command(os.Args[0], "-test.run=^$")
			child.Env = append(os.Environ(), thpChildEnv+"="+setting)
			child.Stderr = os.Stderr
			stdin, err := child.StdinPipe()
			require.NoError(t, err)
			stdout, err := child.StdoutPipe()
			require.NoError(t, err)
			require.NoError(t, child.Start())
			defer func() {
				_ = stdin.Close()
				assert.NoError(t, child.Wait(), "the re-executed test binary ends once its stdin closes")
			}()
			// The child prints its sleep's PID once it is started.
			line, err := bufio.NewReader(stdout).ReadString('\n')
			require.NoError(t, err, "waiting for the child's sleep PID")
			pid, err := strconv.Atoi(strings.TrimSpace(line))
			require.NoError(t, err, "child wrote %q", line)
			status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
			require.NoError(t, err)
			got, err := processTHPEnabled(string(status))
			require.NoError(t, err)
			assert.Equal(t, want, got, "THP_enabled of the grandchild (sleep %d) under %s", pid, setting)
		})
	}
}

// processTHPEnabled reads the THP_enabled line of /proc/PID/status (the
// file's text): false when PR_SET_THP_DISABLE is in force there.
func processTHPEnabled(status string) (bool, error) {
	for _, l := range strings.Split(status, "\n") {
		if f := strings.Fields(l); len(f) == 2 && f[0] == "THP_enabled:" {
			switch f[1] {
			case "0":
				return false, nil
			case "1":
				return true, nil
			}
			return false, fmt.Errorf("THP_enabled: %q, want 0 or 1", f[1])
		}
	}
	return false, fmt.Errorf("no THP_enabled line in /proc/PID/status")
}
