package config

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
)

// amd64Env is an x86-64 host whose firmware files all exist.
var amd64Env = Environment{Hostname: "Host-A", HostIP: "10.0.0.5", HostArch: "amd64", FileExists: func(string) bool { return true }}

func resolveString(t *testing.T, body string, e Environment) (*Node, error) {
	t.Helper()
	c, err := Decode([]byte(header + body))
	require.NoError(t, err)
	return Resolve(c, e)
}

func TestGuestArchitecturesDefaults(t *testing.T) {
	n, err := resolveString(t, "stateDir: /var/lib/qk\nmaxVMs: 12\nguestArchitectures:\n- arch: arm64\n", amd64Env)
	require.NoError(t, err)
	assert.Equal(t, "amd64", n.GuestArch)
	assert.Equal(t, "/usr/share/OVMF/OVMF_CODE_4M.fd", n.UEFICode)
	require.Len(t, n.GuestArchitectures, 1)
	g := n.GuestArchitectures[0]
	assert.Equal(t, "host-a-arm64", g.NodeName)
	assert.Equal(t, "arm64", g.GuestArch)
	assert.Equal(t, int32(DefaultGuestArchMaxVMs), g.MaxVMs)
	assert.Equal(t, int32(10251), g.Port)
	assert.Equal(t, "qemu-system-aarch64", g.QEMUBinary)
	assert.Equal(t, "/usr/share/AAVMF/AAVMF_CODE.fd", g.UEFICode)
	assert.Equal(t, "/usr/share/AAVMF/AAVMF_VARS.fd", g.UEFIVars)
	assert.Equal(t, filepath.Join("/var/lib/qk", GuestArchDirName, "arm64"), g.StateDir)
	assert.Equal(t, PolicyPreferKVM, g.AcceleratorPolicy) // answered TCG without a probe: qemu.Arch.CanKVM
	assert.Empty(t, g.Reserved)
	assert.Equal(t, "Host-A", g.Hostname)
	assert.InDelta(t, 0.25, g.CapacityShare, 1e-9) // 4 of 16 VMs
	assert.InDelta(t, 0.75, n.CapacityShare, 1e-9)
	assert.Empty(t, g.GuestArchitectures)
	// Shared settings are the main node's.
	assert.Equal(t, n.NodeIP, g.NodeIP)
	assert.Equal(t, n.Images, g.Images)
	assert.NotEmpty(t, n.Reserved[corev1.ResourceMemory])

	// Without entries the main node has all of the host.
	n, err = resolveString(t, "", amd64Env)
	require.NoError(t, err)
	assert.Empty(t, n.GuestArchitectures)
	assert.InDelta(t, 1.0, n.CapacityShare, 1e-9)

	// An arm64 host: the main node is arm64 with AAVMF, an amd64 entry gets OVMF.
	armEnv := amd64Env
	armEnv.HostArch = "arm64"
	n, err = resolveString(t, "guestArchitectures:\n- {arch: amd64, capacityShare: 0.5, port: 10300, nodeName: x86-pool}\n", armEnv)
	require.NoError(t, err)
	assert.Equal(t, "/usr/share/AAVMF/AAVMF_CODE.fd", n.UEFICode)
	g = n.GuestArchitectures[0]
	assert.Equal(t, "x86-pool", g.NodeName)
	assert.Equal(t, "qemu-system-x86_64", g.QEMUBinary)
	assert.Equal(t, "/usr/share/OVMF/OVMF_CODE_4M.fd", g.UEFICode)
	assert.Equal(t, int32(10300), g.Port)
	assert.InDelta(t, 0.5, g.CapacityShare, 1e-9)

	// No firmware installed: UEFI pods refused on that node (empty paths).
	none := amd64Env
	none.FileExists = func(string) bool { return false }
	n, err = resolveString(t, "guestArchitectures:\n- arch: arm64\n", none)
	require.NoError(t, err)
	assert.Empty(t, n.GuestArchitectures[0].UEFICode)
}

func TestGuestArchitecturesValidation(t *testing.T) {
	for _, tc := range []struct {
		name, body string
		want       []string
	}{
		{"unknown arch", "guestArchitectures:\n- arch: riscv64\n", []string{`guestArchitectures[0].arch: Unsupported value: "riscv64"`}},
		{"QEMU name instead of Kubernetes name", "guestArchitectures:\n- arch: aarch64\n", []string{`guestArchitectures[0].arch: Unsupported value: "aarch64"`}},
		{"host arch", "guestArchitectures:\n- arch: amd64\n", []string{"guestArchitectures[0].arch", "is the host's architecture"}},
		{"twice", "guestArchitectures:\n- arch: arm64\n- arch: arm64\n  nodeName: other\n", []string{"guestArchitectures[1].arch: Duplicate value"}},
		{"node name of the main node", "nodeName: n1\nguestArchitectures:\n- {arch: arm64, nodeName: n1}\n", []string{"guestArchitectures[0].nodeName: Duplicate value", "the main node"}},
		{"bad node name", "guestArchitectures:\n- {arch: arm64, nodeName: Bad_Name}\n", []string{"guestArchitectures[0].nodeName: Invalid value"}},
		{"port of the main node", "server: {port: 10250}\nguestArchitectures:\n- {arch: arm64, port: 10250}\n", []string{"guestArchitectures[0].port: Duplicate value", "the main node"}},
		{"port out of range", "guestArchitectures:\n- {arch: arm64, port: 70000}\n", []string{"guestArchitectures[0].port: Invalid value: 70000"}},
		{"maxVMs", "guestArchitectures:\n- {arch: arm64, maxVMs: 0}\n", []string{"guestArchitectures[0].maxVMs: Invalid value: 0"}},
		{"share", "guestArchitectures:\n- {arch: arm64, capacityShare: 1.5}\n", []string{"guestArchitectures[0].capacityShare: Invalid value: 1.5", "add up to less than 1"}},
		{"firmware half", "guestArchitectures:\n- {arch: arm64, firmware: {uefiCode: /x/code.fd}}\n", []string{"guestArchitectures[0].firmware", "set both or neither"}},
		{"relative kubeconfig", "guestArchitectures:\n- {arch: arm64, kubeconfig: kc.yaml}\n", []string{"guestArchitectures[0].kubeconfig: Invalid value"}},
		{"label", "guestArchitectures:\n- {arch: arm64, labels: {\"bad key!\": x}}\n", []string{"guestArchitectures[0].labels[bad key!]"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := resolveString(t, tc.body, amd64Env)
			require.Error(t, err)
			for _, w := range tc.want {
				assert.Contains(t, err.Error(), w)
			}
		})
	}
	// Unknown fields of an entry are named.
	_, err := Decode([]byte(header + "guestArchitectures:\n- arch: arm64\n  maxVM: 3\n"))
	require.Error(t, err)
	assert.True(t, strings.Contains(err.Error(), `unknown field "guestArchitectures[0].maxVM"`), err.Error())
}
