package config

import (
	"strings"
	"testing"

	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestResolveCPUModel: cpuModel's models reach the node by accelerator;
// absent, none (qemu's defaults); a malformed model, or host for TCG, is
// refused with the field named; guest-architecture nodes keep none.
func TestResolveCPUModel(t *testing.T) {
	cases := []struct {
		name string
		body string
		want map[qemu.Accelerator]string
		errs []string // substrings of the error; none: accepted
	}{
		{name: "absent", body: "", want: nil},
		{name: "empty section", body: "cpuModel: {}", want: nil},
		{name: "tcg only", body: "cpuModel: {tcg: max}", want: map[qemu.Accelerator]string{qemu.AccelTCG: "max"}},
		{name: "both, with features", body: "cpuModel: {kvm: 'host,pmu=off', tcg: 'max,la57=off'}",
			want: map[qemu.Accelerator]string{qemu.AccelKVM: "host,pmu=off", qemu.AccelTCG: "max,la57=off"}},
		{name: "host for tcg", body: "cpuModel: {tcg: host}", errs: []string{"cpuModel.tcg", "host needs KVM"}},
		{name: "option injection", body: "cpuModel: {kvm: 'host,,help'}", errs: []string{"cpuModel.kvm", `cpu model "host,,help"`}},
		{name: "spaces", body: "cpuModel: {tcg: 'max -device x'}", errs: []string{"cpuModel.tcg", "want a QEMU CPU model"}},
		{name: "too long", body: "cpuModel: {tcg: 'max" + strings.Repeat(",a=on", 120) + "'}", errs: []string{"cpuModel.tcg", "at most 512 characters"}},
		{name: "both bad, both named", body: "cpuModel: {kvm: '-x', tcg: host}", errs: []string{"cpuModel.kvm", "cpuModel.tcg"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			n, err := resolveString(t, tc.body+"\n", env)
			if len(tc.errs) > 0 {
				require.Error(t, err)
				for _, w := range tc.errs {
					assert.Contains(t, err.Error(), w)
				}
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.want, n.CPUModels)
		})
	}
	n, err := resolveString(t, "cpuModel: {tcg: max}\nguestArchitectures:\n- arch: arm64\n", amd64Env)
	require.NoError(t, err)
	assert.Equal(t, map[qemu.Accelerator]string{qemu.AccelTCG: "max"}, n.CPUModels)
	require.Len(t, n.GuestArchitectures, 1)
	assert.Nil(t, n.GuestArchitectures[0].CPUModels, "an x86 model is not an arm64 guest's")
}
