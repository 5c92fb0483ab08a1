package config

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
)

const header = "apiVersion: qemu-kubelet.io/v1alpha1\nkind: NodeConfiguration\n"

var env = Environment{Hostname: "Host-A", HostIP: "10.0.0.5"}

func TestDecode(t *testing.T) {
	tests := []struct {
		name    string
		in      string
		wantErr []string // substrings; empty = success
	}{
		{name: "minimal", in: header},
		{name: "json", in: `{"apiVersion":"qemu-kubelet.io/v1alpha1","kind":"NodeConfiguration","maxVMs":3}`},
		{name: "empty file", in: "", wantErr: []string{"empty file"}},
		{name: "wrong kind", in: "apiVersion: qemu-kubelet.io/v1alpha1\nkind: KubeletConfiguration\n", wantErr: []string{`kind "KubeletConfiguration"`, Kind}},
		{name: "missing apiVersion", in: "kind: NodeConfiguration\n", wantErr: []string{`apiVersion ""`}},
		{name: "unknown top-level field", in: header + "maxVM: 3\n", wantErr: []string{`unknown field "maxVM"`}},
		{name: "unknown nested field", in: header + "reserved: {memory: 1Gi}\nserver:\n  prot: 1\n", wantErr: []string{`unknown field "server.prot"`}},
		{name: "unknown taint field", in: header + "taints:\n- key: a\n  effect: NoSchedule\n  colour: red\n", wantErr: []string{`unknown field "taints[0].colour"`}},
		{name: "duplicate field", in: header + "maxVMs: 3\nmaxVMs: 4\n", wantErr: []string{"maxVMs"}},
		{name: "wrong type names field", in: header + "maxVMs: many\n", wantErr: []string{"maxVMs"}},
		{name: "user name for a uid", in: header + "vmUser: {uid: qemu, gid: 107}\n", wantErr: []string{"vmUser.uid", "int64"}},
		{name: "bad yaml", in: header + "labels: [\n", wantErr: []string{"parse YAML"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := Decode([]byte(tt.in))
			if len(tt.wantErr) == 0 {
				require.NoError(t, err)
				assert.Equal(t, APIVersion, c.APIVersion)
				return
			}
			require.Error(t, err)
			for _, w := range tt.wantErr {
				assert.Contains(t, err.Error(), w)
			}
		})
	}
}

func TestLoadNamesFile(t *testing.T) {
	p := filepath.Join(t.TempDir(), "node.yaml")
	require.NoError(t, os.WriteFile(p, []byte(header+"bogus: 1\n"), 0o600))
	_, err := Load(p)
	require.Error(t, err)
	assert.Contains(t, err.Error(), p)
	assert.Contains(t, err.Error(), `unknown field "bogus"`)

	_, err = Load(filepath.Join(t.TempDir(), "missing.yaml"))
	require.Error(t, err)
	assert.Contains(t, err.Error(), "missing.yaml")
}

func TestResolveDefaults(t *testing.T) {
	c, err := Decode([]byte(header))
	require.NoError(t, err)
	n, err := Resolve(c, env)
	require.NoError(t, err)

	assert.Equal(t, "host-a", n.NodeName)
	assert.Equal(t, "Host-A", n.Hostname)
	assert.Equal(t, "10.0.0.5", n.NodeIP)
	assert.Equal(t, DefaultStateDir, n.StateDir)
	assert.Equal(t, DefaultQEMUBinary(), n.QEMUBinary)
	assert.Equal(t, int32(DefaultMaxVMs), n.MaxVMs)
	assert.Equal(t, 1.0, n.CPUOvercommit)
	assert.Equal(t, 1.0, n.MemoryOvercommit)
	assert.Equal(t, PolicyPreferKVM, n.AcceleratorPolicy)
	assert.Equal(t, 30*time.Second, n.ProbeTimeout)
	assert.Equal(t, DefaultTaints(), n.Taints)
	assert.Equal(t, "0.0.0.0", n.ListenAddress)
	assert.Equal(t, int32(10250), n.Port)
	assert.Equal(t, 10*time.Second, n.StatusUpdateFrequency)
	assert.Equal(t, 40*time.Second, n.LeaseDuration)
	assert.Equal(t, float32(50), n.KubeAPIQPS, "the kubelet's default, not client-go's 5")
	assert.Equal(t, 100, n.KubeAPIBurst)
	assert.Equal(t, float32(50), n.EventRecordQPS)
	assert.Equal(t, 100, n.EventBurst)
	assert.Equal(t, 10, n.PodSyncWorkers, "virtual-kubelet's default, not the 2 of a bare PodController.Run")
	assert.Equal(t, 10, n.VMNice, "guests below the agent by default: a burst's control path is not starved (docs/performance.md)")
	assert.Equal(t, []string{"tsc=reliable", "sysctl.vm.compaction_proactiveness=0"}, n.EmulatedKernelArgs, "measured: idle QEMU CPU 0.58% -> 0.22% (docs/performance.md)")
	assert.Equal(t, Threshold{Amount: 100 << 20}, n.MemoryAvailable)
	assert.Equal(t, Threshold{Percent: 10, IsPercent: true}, n.DiskAvailable)
	assert.Equal(t, Threshold{Percent: 5, IsPercent: true}, n.PIDAvailable)
	mem := n.Reserved[corev1.ResourceMemory]
	assert.Equal(t, int64(512<<20), mem.Value())
	assert.Equal(t, VMCgroupConfig{Own: false, Root: "/sys/fs/cgroup", Parent: "qemu-kubelet", CPUWeight: 100}, n.VMCgroup, "QEMU in the agent's cgroup unless asked")

	// Resolve does not modify its input.
	assert.Empty(t, c.NodeName)
	assert.Nil(t, c.Taints)
}

func TestResolveExplicit(t *testing.T) {
	c, err := Decode([]byte(header + `
nodeName: vm-host-1
nodeIP: 127.0.0.1
stateDir: /srv/qk
qemuBinary: /opt/qemu/bin/qemu-system-x86_64
maxVMs: 7
reserved: {cpu: 0.5, memory: 2Gi}
overcommit: {cpu: 4, memory: 1.5}
accelerator: {policy: tcg, probeTimeout: 5s}
taints: []
labels: {pool: ci}
server: {address: 127.0.0.1, port: 11250, tlsCertFile: /c.pem, tlsPrivateKeyFile: /k.pem, clientCAFile: /ca.pem}
nodeStatusUpdateFrequency: 2s
nodeLeaseDurationSeconds: 12
kubeAPIQPS: 20
kubeAPIBurst: 40
eventRecordQPS: 5
eventBurst: 10
podSyncWorkers: 4
pressure: {memoryAvailable: "0", diskAvailable: 5Gi, pidAvailable: 1000}
vmCgroup: {mode: Own, root: /host/sys/fs/cgroup, parent: machine/qk, namespace: /proc/1/ns/cgroup, cpuWeight: 0}
`))
	require.NoError(t, err)
	n, err := Resolve(c, env)
	require.NoError(t, err)
	assert.Equal(t, "vm-host-1", n.NodeName)
	assert.Equal(t, int32(7), n.MaxVMs)
	assert.Empty(t, n.Taints, "an explicit empty list means no taint")
	assert.NotNil(t, n.Taints)
	assert.Equal(t, 4.0, n.CPUOvercommit)
	assert.Equal(t, 1.5, n.MemoryOvercommit)
	assert.Equal(t, PolicyTCG, n.AcceleratorPolicy)
	assert.Equal(t, map[string]string{"pool": "ci"}, n.Labels)
	assert.Equal(t, int32(11250), n.Port)
	assert.Equal(t, "/c.pem", n.TLSCertFile)
	assert.Equal(t, "/ca.pem", n.ClientCAFile)
	cpu := n.Reserved[corev1.ResourceCPU]
	assert.Equal(t, int64(500), cpu.MilliValue())
	_, hasStorage := n.Reserved[corev1.ResourceEphemeralStorage]
	assert.False(t, hasStorage, "an explicit reserved map replaces the default")
	assert.False(t, n.MemoryAvailable.Crossed(0, 100), "0 disables")
	assert.Equal(t, int64(1000), n.PIDAvailable.Amount)
	assert.Equal(t, 12*time.Second, n.LeaseDuration)
	assert.Equal(t, float32(20), n.KubeAPIQPS)
	assert.Equal(t, 40, n.KubeAPIBurst)
	assert.Equal(t, float32(5), n.EventRecordQPS)
	assert.Equal(t, 10, n.EventBurst)
	assert.Equal(t, 4, n.PodSyncWorkers)
	assert.Equal(t, VMCgroupConfig{Own: true, Root: "/host/sys/fs/cgroup", Parent: "machine/qk", Namespace: "/proc/1/ns/cgroup"}, n.VMCgroup, "cpuWeight 0: no weight, nice only")
}

// vmUser: absent is 107:107 for a root agent and the agent's own user
// otherwise; uid 0 only when written; a non-root agent cannot name
// another user.
func TestResolveVMUser(t *testing.T) {
	nonRoot := env
	nonRoot.AgentUID, nonRoot.AgentGID = 1000, 1001
	for _, tt := range []struct {
		body string
		env  Environment
		want VMUserConfig
		err  string
	}{
		{"", env, VMUserConfig{UID: 107, GID: 107}, ""},
		{"", nonRoot, VMUserConfig{UID: 1000, GID: 1001}, ""},
		{"vmUser: {uid: 0, gid: 0}", env, VMUserConfig{}, ""},
		{"vmUser: {uid: 64055, gid: 108}", env, VMUserConfig{UID: 64055, GID: 108}, ""},
		{"vmUser: {uid: 1000, gid: 1001}", nonRoot, VMUserConfig{UID: 1000, GID: 1001}, ""},
		{"vmUser: {uid: 107, gid: 107}", nonRoot, VMUserConfig{}, "vmUser: Invalid value: \"107:107\": the agent runs as uid 1000 gid 1001 and cannot start QEMU as another user"},
		{"vmUser: {}", env, VMUserConfig{UID: 107, GID: 107}, ""},
	} {
		c, err := Decode([]byte(header + tt.body + "\n"))
		require.NoError(t, err)
		n, err := Resolve(c, tt.env)
		if tt.err != "" {
			require.ErrorContains(t, err, tt.err, "body %q", tt.body)
			continue
		}
		require.NoError(t, err, "body %q", tt.body)
		assert.Equal(t, tt.want, n.VMUser, "body %q agent %d", tt.body, tt.env.AgentUID)
	}
}

func TestResolveValidation(t *testing.T) {
	tests := []struct {
		name string
		body string
		want []string
	}{
		{"negative reserved memory", "reserved: {memory: -1Gi}", []string{"reserved[memory]", "must not be negative"}},
		{"bad reserved quantity", "reserved: {cpu: lots}", []string{"reserved[cpu]", `"lots"`, "resource quantity"}},
		{"unsupported reserved resource", "reserved: {gpu: 1}", []string{"reserved[gpu]", "supported values"}},
		{"zero max VMs", "maxVMs: 0", []string{"maxVMs", "between 1 and 10000"}},
		{"bad node name", "nodeName: Bad_Name", []string{"nodeName", "Bad_Name"}},
		{"bad node IP", "nodeIP: not-an-ip", []string{"nodeIP"}},
		{"relative state dir", "stateDir: var/lib", []string{"stateDir", "absolute"}},
		{"overcommit zero", "overcommit: {cpu: 0}", []string{"overcommit.cpu"}},
		{"overcommit huge", "overcommit: {memory: 1000}", []string{"overcommit.memory"}},
		{"bad policy", "accelerator: {policy: kvm-please}", []string{"accelerator.policy", "require-kvm"}},
		{"bad probe timeout", "accelerator: {probeTimeout: soon}", []string{"accelerator.probeTimeout", "duration"}},
		{"bad taint effect", "taints: [{key: a, effect: Sometimes}]", []string{"taints[0].effect"}},
		{"bad taint key", "taints: [{key: 'a b', effect: NoSchedule}]", []string{"taints[0].key"}},
		{"duplicate taint", "taints: [{key: a, effect: NoSchedule}, {key: a, value: b, effect: NoSchedule}]", []string{"taints[1]", "Duplicate"}},
		{"bad label", "labels: {'x/y/z': v}", []string{"labels[x/y/z]"}},
		{"bad port", "server: {port: 70000}", []string{"server.port"}},
		{"bad address", "server: {address: localhost}", []string{"server.address"}},
		{"cert without key", "server: {tlsCertFile: /c.pem}", []string{"server.tlsCertFile", "together"}},
		{"too fast status", "nodeStatusUpdateFrequency: 10ms", []string{"nodeStatusUpdateFrequency", "at least 1s"}},
		{"lease too short", "nodeLeaseDurationSeconds: 1", []string{"nodeLeaseDurationSeconds", "between 4 and 3600"}},
		{"zero qps", "kubeAPIQPS: 0", []string{"kubeAPIQPS", "at least 1"}},
		{"burst below qps", "kubeAPIQPS: 200", []string{"kubeAPIBurst", "at least kubeAPIQPS (200)"}},
		{"event burst below qps", "eventRecordQPS: 10\neventBurst: 2", []string{"eventBurst", "at least eventRecordQPS (10)"}},
		{"no pod sync workers", "podSyncWorkers: 0", []string{"podSyncWorkers", "between 1 and 1000"}},
		{"negative vm nice", "vmNice: -5", []string{"vmNice", "between 0 and 19"}},
		{"vm nice too large", "vmNice: 20", []string{"vmNice", "between 0 and 19"}},
		{"kernel arg with a space", "emulatedKernelArgs: [tsc=reliable, 'a b']", []string{"emulatedKernelArgs[1]", "no spaces"}},
		{"empty kernel arg", "emulatedKernelArgs: ['']", []string{"emulatedKernelArgs[0]", "empty"}},
		{"kernel arg --", "emulatedKernelArgs: ['--']", []string{"emulatedKernelArgs[0]", "init"}},
		{"bad percent", "pressure: {diskAvailable: 150%}", []string{"pressure.diskAvailable", "percentage"}},
		{"bad threshold", "pressure: {memoryAvailable: plenty}", []string{"pressure.memoryAvailable"}},
		{"several errors listed", "maxVMs: -1\nserver: {port: 0}", []string{"maxVMs", "server.port"}},
		{"bad overhead", "vmMemory: {overhead: lots}", []string{"vmMemory.overhead", "quantity"}},
		{"negative overhead", "vmMemory: {overhead: -1Mi}", []string{"vmMemory.overhead", "at least 0"}},
		{"tiny idle cost", "vmMemory: {idleCost: 1Ki}", []string{"vmMemory.idleCost", "at least 1Mi"}},
		{"tb size not whole MiB", "vmMemory: {tcgTranslationBuffer: 1500Ki}", []string{"vmMemory.tcgTranslationBuffer", "whole MiB"}},
		{"tb size too big", "vmMemory: {tcgTranslationBuffer: 8Gi}", []string{"vmMemory.tcgTranslationBuffer", "4096Mi"}},
		{"ksm without merging", "vmMemory: {enableKSM: true}", []string{"vmMemory.enableKSM", "pageMerging"}},
		{"ksm rate without ksm", "vmMemory: {ksmPagesToScan: 1000}", []string{"vmMemory.ksmPagesToScan", "enableKSM"}},
		{"bad vm cgroup mode", "vmCgroup: {mode: own}", []string{"vmCgroup.mode", `"Inherit", "Own"`}},
		{"relative vm cgroup namespace", "vmCgroup: {namespace: proc/1/ns/cgroup}", []string{"vmCgroup.namespace", "absolute"}},
		{"relative vm cgroup root", "vmCgroup: {root: sys/fs/cgroup}", []string{"vmCgroup.root", "absolute"}},
		{"absolute vm cgroup parent", "vmCgroup: {mode: Own, parent: /qemu-kubelet}", []string{"vmCgroup.parent", "relative to the cgroup root"}},
		{"vm cgroup parent escapes", "vmCgroup: {parent: ../x}", []string{"vmCgroup.parent", "no . or .."}},
		{"vm cgroup parent clashes", "vmCgroup: {parent: qk/cgroup.procs}", []string{"vmCgroup.parent", "cgroup.procs", "interface files"}},
		{"vm cgroup parent spaces", "vmCgroup: {parent: 'my vms'}", []string{"vmCgroup.parent", "[A-Za-z0-9._-]"}},
		{"vm cpu weight too high", "vmCgroup: {cpuWeight: 10001}", []string{"vmCgroup.cpuWeight", "1 to 10000"}},
		{"vm cpu weight negative", "vmCgroup: {cpuWeight: -5}", []string{"vmCgroup.cpuWeight", "vmNice only"}},
		{"vm uid without gid", "vmUser: {uid: 1000}", []string{"vmUser.gid: Required value", "set both uid and gid"}},
		{"vm gid without uid", "vmUser: {gid: 1000}", []string{"vmUser.uid: Required value"}},
		{"negative vm uid", "vmUser: {uid: -1, gid: 107}", []string{"vmUser.uid", "-1", "between 0 and 4294967294"}},
		{"vm gid (gid_t)-1", "vmUser: {uid: 107, gid: 4294967295}", []string{"vmUser.gid", "between 0 and 4294967294"}},
		{"ksm rate negative", "vmMemory: {pageMerging: true, enableKSM: true, ksmPagesToScan: -1}", []string{"vmMemory.ksmPagesToScan", "between 0 and 100000"}},
		{"thp lower case", "vmMemory: {transparentHugePages: disabled}", []string{"vmMemory.transparentHugePages", `"disabled"`, `"Auto", "Enabled", "Disabled"`}},
		{"thp bool", "vmMemory: {transparentHugePages: 'off'}", []string{"vmMemory.transparentHugePages", `"off"`, `"Auto", "Enabled", "Disabled"`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := Decode([]byte(header + tt.body + "\n"))
			require.NoError(t, err)
			_, err = Resolve(c, env)
			require.Error(t, err)
			for _, w := range tt.want {
				assert.Contains(t, err.Error(), w)
			}
		})
	}
}

// emulatedKernelArgs: absent is the defaults, [] is none, a list is that
// list.
func TestResolveEmulatedKernelArgs(t *testing.T) {
	for body, want := range map[string][]string{
		"":                                  DefaultEmulatedKernelArgs,
		"emulatedKernelArgs: []":            nil,
		"emulatedKernelArgs: [highres=off]": {"highres=off"},
	} {
		c, err := Decode([]byte(header + body + "\n"))
		require.NoError(t, err)
		n, err := Resolve(c, env)
		require.NoError(t, err)
		assert.Equal(t, want, n.EmulatedKernelArgs, "body %q", body)
	}
}

func TestResolveKSMPagesToScan(t *testing.T) {
	c, err := Decode([]byte(header + "vmMemory: {pageMerging: true, enableKSM: true, ksmPagesToScan: 1000}\n"))
	require.NoError(t, err)
	n, err := Resolve(c, env)
	require.NoError(t, err)
	assert.Equal(t, 1000, n.VMMemory.KSMPagesToScan)
	c, err = Decode([]byte(header))
	require.NoError(t, err)
	n, err = Resolve(c, env)
	require.NoError(t, err)
	assert.Equal(t, 0, n.VMMemory.KSMPagesToScan, "absent: the kernel's rate")
}

func TestResolveTransparentHugePages(t *testing.T) {
	for body, want := range map[string]string{
		"":                                       THPAuto,
		"vmMemory: {transparentHugePages: Auto}": THPAuto,
		"vmMemory: {transparentHugePages: Enabled}":  THPEnabled,
		"vmMemory: {transparentHugePages: Disabled}": THPDisabled,
	} {
		c, err := Decode([]byte(header + body + "\n"))
		require.NoError(t, err)
		n, err := Resolve(c, env)
		require.NoError(t, err)
		assert.Equal(t, want, n.VMMemory.TransparentHugePages, "body %q", body)
	}
}

func TestThreshold(t *testing.T) {
	tests := []struct {
		in               string
		available, total int64
		crossed          bool
	}{
		{"10%", 9, 100, true},
		{"10%", 10, 100, false},
		{"100Mi", 99 << 20, 1 << 40, true},
		{"100Mi", 101 << 20, 1 << 40, false},
		{"0", 0, 100, false},
		{"0%", 0, 100, false},
	}
	for _, tt := range tests {
		th, err := ParseThreshold(tt.in)
		require.NoError(t, err, tt.in)
		assert.Equal(t, tt.crossed, th.Crossed(tt.available, tt.total), "%s %d/%d", tt.in, tt.available, tt.total)
		back, err := ParseThreshold(th.String())
		require.NoError(t, err)
		assert.Equal(t, th, back, "String round-trips")
	}
	_, err := ParseThreshold("-5Mi")
	assert.Error(t, err)
}
