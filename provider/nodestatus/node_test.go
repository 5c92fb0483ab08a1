package nodestatus

import (
	"context"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

const gi = int64(1) << 30

func resolve(t *testing.T, body string) *config.Node {
	t.Helper()
	c, err := config.Decode([]byte("apiVersion: qemu-kubelet.io/v1alpha1\nkind: NodeConfiguration\nnodeName: n1\nnodeIP: 10.1.2.3\n" + body))
	require.NoError(t, err)
	n, err := config.Resolve(c, config.Environment{Hostname: "host1"})
	require.NoError(t, err)
	return n
}

func q(s string) *resource.Quantity { v := resource.MustParse(s); return &v }

func TestCapacityAndAllocatable(t *testing.T) {
	host := HostReadings{CPUs: 8, MemoryTotal: 16 * gi, DiskTotal: 100 * gi}
	tests := []struct {
		name     string
		cfg      string
		wantCap  map[corev1.ResourceName]string
		wantAllo map[corev1.ResourceName]string
	}{
		{
			name:     "defaults",
			cfg:      "",
			wantCap:  map[corev1.ResourceName]string{"cpu": "8", "memory": "16Gi", "ephemeral-storage": "100Gi", "pods": "20"},
			wantAllo: map[corev1.ResourceName]string{"cpu": "8", "memory": "15872Mi", "ephemeral-storage": "99Gi", "pods": "20"},
		},
		{
			name:     "overcommit and reserved",
			cfg:      "maxVMs: 50\novercommit: {cpu: 4, memory: 1.5}\nreserved: {cpu: 500m, memory: 2Gi, ephemeral-storage: 10Gi}\n",
			wantCap:  map[corev1.ResourceName]string{"cpu": "32", "memory": "24Gi", "ephemeral-storage": "100Gi", "pods": "50"},
			wantAllo: map[corev1.ResourceName]string{"cpu": "31500m", "memory": "22Gi", "ephemeral-storage": "90Gi", "pods": "50"},
		},
		{
			name:     "undercommit",
			cfg:      "overcommit: {cpu: 0.5, memory: 0.25}\nreserved: {}\n",
			wantCap:  map[corev1.ResourceName]string{"cpu": "4", "memory": "4Gi", "ephemeral-storage": "100Gi", "pods": "20"},
			wantAllo: map[corev1.ResourceName]string{"cpu": "4", "memory": "4Gi", "ephemeral-storage": "100Gi", "pods": "20"},
		},
		{
			name:     "reserved above capacity clamps at zero",
			cfg:      "reserved: {cpu: 64, memory: 1Ti, ephemeral-storage: 1Pi}\n",
			wantCap:  map[corev1.ResourceName]string{"cpu": "8", "memory": "16Gi", "ephemeral-storage": "100Gi", "pods": "20"},
			wantAllo: map[corev1.ResourceName]string{"cpu": "0", "memory": "0", "ephemeral-storage": "0", "pods": "20"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := resolve(t, tt.cfg)
			capacity := Capacity(cfg, host)
			alloc := Allocatable(capacity, cfg.Reserved)
			require.Len(t, capacity, len(tt.wantCap))
			require.Len(t, alloc, len(tt.wantAllo))
			for r, want := range tt.wantCap {
				got := capacity[r]
				assert.Zero(t, q(want).Cmp(got), "capacity %s: want %s got %s", r, want, got.String())
			}
			for r, want := range tt.wantAllo {
				got := alloc[r]
				assert.Zero(t, q(want).Cmp(got), "allocatable %s: want %s got %s", r, want, got.String())
				assert.GreaterOrEqual(t, got.Sign(), 0)
			}
		})
	}
}

func TestAllocatableDoesNotAlias(t *testing.T) {
	capacity := corev1.ResourceList{corev1.ResourceCPU: *q("2")}
	_ = Allocatable(capacity, corev1.ResourceList{corev1.ResourceCPU: *q("1")})
	c := capacity[corev1.ResourceCPU]
	assert.Equal(t, "2", c.String(), "capacity must not be modified")
}

func facts(cfg *config.Node) Facts {
	return Facts{
		Config: cfg, Version: "v0.1.0-test", QEMUVersion: "7.2.22",
		Host:        HostInfo{KernelVersion: "6.1.0-test", OSImage: "Debian GNU/Linux 12 (bookworm)"},
		Accelerator: Accelerator{Name: "tcg", Reason: "KVM probe failed: boom; falling back to TCG", KVMError: "boom"},
	}
}

func healthyHost() HostReadings {
	return HostReadings{CPUs: 2, MemoryTotal: 8 * gi, MemoryAvailable: 4 * gi, DiskTotal: 100 * gi, DiskAvailable: 50 * gi, PIDMax: 100000, PIDsInUse: 500}
}

func condMap(cs []corev1.NodeCondition) map[corev1.NodeConditionType]corev1.NodeCondition {
	m := map[corev1.NodeConditionType]corev1.NodeCondition{}
	for _, c := range cs {
		m[c.Type] = c
	}
	return m
}

func TestConditions(t *testing.T) {
	type want struct {
		status corev1.ConditionStatus
		reason string
	}
	tests := []struct {
		name   string
		mutate func(*Facts, *HostReadings)
		want   map[corev1.NodeConditionType]want
	}{
		{
			name: "healthy tcg",
			want: map[corev1.NodeConditionType]want{
				corev1.NodeReady:          {"True", ReasonReady},
				corev1.NodeMemoryPressure: {"False", "KubeletHasSufficientMemory"},
				corev1.NodeDiskPressure:   {"False", "KubeletHasNoDiskPressure"},
				corev1.NodePIDPressure:    {"False", "KubeletHasSufficientPID"},
				ConditionKVM:              {"False", "KVMProbeFailed"},
			},
		},
		{
			name:   "kvm works",
			mutate: func(f *Facts, _ *HostReadings) { f.Accelerator = Accelerator{Name: "kvm", Reason: "ok"} },
			want:   map[corev1.NodeConditionType]want{ConditionKVM: {"True", "KVMProbeSucceeded"}, corev1.NodeReady: {"True", ReasonReady}},
		},
		{
			name:   "tcg by policy",
			mutate: func(f *Facts, _ *HostReadings) { f.Accelerator = Accelerator{Name: "tcg", Reason: "policy tcg"} },
			want:   map[corev1.NodeConditionType]want{ConditionKVM: {"False", "KVMNotTried"}},
		},
		{
			name:   "memory pressure",
			mutate: func(_ *Facts, h *HostReadings) { h.MemoryAvailable = 50 << 20 },
			want:   map[corev1.NodeConditionType]want{corev1.NodeMemoryPressure: {"True", "KubeletHasInsufficientMemory"}, corev1.NodeReady: {"True", ReasonReady}},
		},
		{
			name:   "disk pressure below 10%",
			mutate: func(_ *Facts, h *HostReadings) { h.DiskAvailable = 9 * gi },
			want:   map[corev1.NodeConditionType]want{corev1.NodeDiskPressure: {"True", "KubeletHasDiskPressure"}},
		},
		{
			name:   "pid pressure",
			mutate: func(_ *Facts, h *HostReadings) { h.PIDsInUse = 99000 },
			want:   map[corev1.NodeConditionType]want{corev1.NodePIDPressure: {"True", "KubeletHasInsufficientPID"}},
		},
		{
			name:   "state dir unusable",
			mutate: func(_ *Facts, h *HostReadings) { h.StateDirError = "state directory /x not writable" },
			want:   map[corev1.NodeConditionType]want{corev1.NodeReady: {"False", ReasonStateDirUnusable}},
		},
		{
			name:   "qemu missing",
			mutate: func(_ *Facts, h *HostReadings) { h.QEMUError = "not found" },
			want:   map[corev1.NodeConditionType]want{corev1.NodeReady: {"False", ReasonQEMUUnavailable}},
		},
		{
			name: "require-kvm failed",
			mutate: func(f *Facts, _ *HostReadings) {
				f.Accelerator = Accelerator{KVMError: "boom", Error: "accelerator policy require-kvm: KVM probe failed: boom"}
			},
			want: map[corev1.NodeConditionType]want{corev1.NodeReady: {"False", ReasonAcceleratorUnavailable}, ConditionKVM: {"False", "KVMProbeFailed"}},
		},
	}
	now := metav1.NewTime(time.Unix(1000, 0))
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := facts(resolve(t, ""))
			h := healthyHost()
			if tt.mutate != nil {
				tt.mutate(&f, &h)
			}
			got := condMap(Conditions(nil, f, h, now))
			require.Len(t, got, 6) // the pressures, Ready, KVMAccelerated, ConfigOK
			for typ, w := range tt.want {
				c := got[typ]
				assert.Equal(t, w.status, c.Status, "%s status", typ)
				assert.Equal(t, w.reason, c.Reason, "%s reason", typ)
				assert.NotEmpty(t, c.Message, "%s message", typ)
				assert.Equal(t, now, c.LastHeartbeatTime)
			}
		})
	}
}

func TestConditionsKeepTransitionTime(t *testing.T) {
	f := facts(resolve(t, ""))
	t0, t1 := metav1.NewTime(time.Unix(1000, 0)), metav1.NewTime(time.Unix(2000, 0))
	first := Conditions(nil, f, healthyHost(), t0)
	h := healthyHost()
	h.MemoryAvailable = 1 << 20
	second := condMap(Conditions(first, f, h, t1))
	assert.Equal(t, t0, second[corev1.NodeReady].LastTransitionTime, "unchanged status keeps its transition time")
	assert.Equal(t, t1, second[corev1.NodeReady].LastHeartbeatTime)
	assert.Equal(t, t1, second[corev1.NodeMemoryPressure].LastTransitionTime, "changed status gets a new transition time")
}

func TestRegistrationNode(t *testing.T) {
	cfg := resolve(t, "labels: {pool: ci}\nserver: {port: 11250}\n")
	n := RegistrationNode(facts(cfg), healthyHost(), metav1.Now())
	assert.Equal(t, "n1", n.Name)
	assert.Equal(t, []corev1.Taint{{Key: "virtual-kubelet.io/provider", Value: "qemu", Effect: corev1.TaintEffectNoSchedule}}, n.Spec.Taints)
	assert.Equal(t, map[string]string{
		"kubernetes.io/hostname":           "n1",
		"kubernetes.io/os":                 runtime.GOOS,
		"kubernetes.io/arch":               runtime.GOARCH,
		"node.kubernetes.io/instance-type": InstanceTypeQEMU,
		"type":                             "virtual-kubelet",
		LabelAccelerator:                   "tcg",
		"pool":                             "ci",
	}, n.Labels)
	assert.Contains(t, n.Annotations[AnnotationAccelerator], "falling back to TCG")
	assert.Equal(t, "maxVMs 20: the default, host memory unknown", n.Annotations[AnnotationMaxVMs])
	// The pods capacity derived from the host's memory says how.
	c, err := config.Decode([]byte("apiVersion: qemu-kubelet.io/v1alpha1\nkind: NodeConfiguration\nnodeName: n1\nnodeIP: 10.1.2.3\n"))
	require.NoError(t, err)
	derived, err := config.Resolve(c, config.Environment{Hostname: "host1", MemoryTotal: 16 * gi})
	require.NoError(t, err)
	dn := RegistrationNode(facts(derived), healthyHost(), metav1.Now())
	assert.Equal(t, "99", dn.Status.Capacity.Pods().String()) // (16Gi - 512Mi) / 160Mi = 99.2
	assert.Equal(t, "maxVMs 99 derived from host memory: (16384Mi total - 512Mi reserved) x memory overcommit 1 / 160Mi per idle VM (vmMemory.idleCost)",
		dn.Annotations[AnnotationMaxVMs])
	assert.Equal(t, "qemu://7.2.22", n.Status.NodeInfo.ContainerRuntimeVersion)
	assert.Equal(t, "v0.1.0-test", n.Status.NodeInfo.KubeletVersion)
	assert.Equal(t, "6.1.0-test", n.Status.NodeInfo.KernelVersion)
	assert.Equal(t, runtime.GOARCH, n.Status.NodeInfo.Architecture)
	assert.Empty(t, n.Status.NodeInfo.KubeProxyVersion)
	assert.Equal(t, int32(11250), n.Status.DaemonEndpoints.KubeletEndpoint.Port)
	assert.Equal(t, []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: "10.1.2.3"}, {Type: corev1.NodeHostName, Address: "host1"}}, n.Status.Addresses)
	assert.Equal(t, corev1.NodeRunning, n.Status.Phase)
}

func TestNodeStatusNotifiesOnlyOnChange(t *testing.T) {
	cfg := resolve(t, "")
	h := healthyHost()
	s := NewNodeStatus(context.Background(), facts(cfg), func() (HostReadings, error) { return h, nil })
	var got []*corev1.Node
	h.DiskAvailable = 2 * gi // a change before the callback is registered is not lost
	assert.False(t, s.Refresh(context.Background()))
	s.NotifyNodeStatus(context.Background(), func(n *corev1.Node) { got = append(got, n) })
	require.True(t, s.Refresh(context.Background()))
	require.Len(t, got, 1)
	h.DiskAvailable = 50 * gi
	require.True(t, s.Refresh(context.Background()))
	got = nil

	assert.False(t, s.Refresh(context.Background()), "same readings: no notification")
	h.MemoryAvailable = 4*gi - 12345 // fluctuation below the threshold changes nothing visible
	assert.False(t, s.Refresh(context.Background()))

	h.DiskAvailable = 1 * gi
	require.True(t, s.Refresh(context.Background()))
	require.Len(t, got, 1)
	assert.Equal(t, corev1.ConditionTrue, condMap(got[0].Status.Conditions)[corev1.NodeDiskPressure].Status)
	assert.Equal(t, "n1", got[0].Name)
	assert.Equal(t, "tcg", got[0].Labels[LabelAccelerator])
	assert.NoError(t, s.Ping(context.Background()))
}

func TestParsers(t *testing.T) {
	total, avail, err := ParseMeminfo([]byte("MemTotal:       16384 kB\nMemFree:  1 kB\nMemAvailable:    8192 kB\n"))
	require.NoError(t, err)
	assert.Equal(t, int64(16384*1024), total)
	assert.Equal(t, int64(8192*1024), avail)
	_, _, err = ParseMeminfo([]byte("MemTotal: 1 kB\n"))
	assert.Error(t, err)

	n, err := ParseLoadavgTasks([]byte("0.10 0.20 0.30 2/345 6789\n"))
	require.NoError(t, err)
	assert.Equal(t, int64(345), n)
	_, err = ParseLoadavgTasks([]byte("0.1 0.2"))
	assert.Error(t, err)

	assert.Equal(t, "Debian GNU/Linux 12 (bookworm)", ParseOSRelease([]byte("NAME=\"Debian GNU/Linux\"\nPRETTY_NAME=\"Debian GNU/Linux 12 (bookworm)\"\n")))
	assert.Equal(t, "Foo 1.0", ParseOSRelease([]byte("NAME=Foo\nVERSION='1.0'\n")))
}

func TestHostSourceRead(t *testing.T) {
	dir := t.TempDir()
	h, err := HostSource{StateDir: dir + "/state", QEMUBinary: "sh"}.Read()
	require.NoError(t, err)
	assert.Empty(t, h.StateDirError)
	assert.Empty(t, h.QEMUError)
	assert.Positive(t, h.CPUs)
	assert.Positive(t, h.MemoryTotal)
	assert.Positive(t, h.DiskTotal)
	assert.Positive(t, h.PIDMax)
	assert.Positive(t, h.PIDsInUse)

	h, _ = HostSource{StateDir: "/proc/self/state-cannot-exist", QEMUBinary: "no-such-qemu-binary"}.Read()
	assert.Contains(t, h.StateDirError, "/proc/self/state-cannot-exist")
	assert.True(t, strings.Contains(h.QEMUError, "no-such-qemu-binary"))
}

// TestGuestArchitectureNode: a guestArchitectures entry is a node of its
// own: labelled and reporting its guest architecture, with maxVMs as pods
// and its share of the host's cpu, memory and disk; the main node keeps the
// rest and the host's reserve.
func TestGuestArchitectureNode(t *testing.T) {
	foreign := "arm64"
	if runtime.GOARCH == "arm64" {
		foreign = "amd64"
	}
	host := HostReadings{CPUs: 8, MemoryTotal: 16 * gi, DiskTotal: 100 * gi}
	main := resolve(t, "maxVMs: 12\nguestArchitectures:\n- arch: "+foreign+"\n  maxVMs: 4\n  labels: {pool: emulated}\n")
	require.Len(t, main.GuestArchitectures, 1)
	g := main.GuestArchitectures[0]
	for _, tc := range []struct {
		cfg                  *config.Node
		arch, cpu, mem, disk string
		pods                 string
		allocatableMemory    string
	}{
		{main, runtime.GOARCH, "6", "12Gi", "75Gi", "12", "11776Mi"}, // 3/4 of the host, minus 512Mi reserved
		{g, foreign, "2", "4Gi", "25Gi", "4", "4Gi"},                 // maxVMs 4 of 16: a quarter, nothing reserved
	} {
		capacity := Capacity(tc.cfg, host)
		for r, want := range map[corev1.ResourceName]string{"cpu": tc.cpu, "memory": tc.mem, "ephemeral-storage": tc.disk, "pods": tc.pods} {
			got := capacity[r]
			assert.Zero(t, q(want).Cmp(got), "%s capacity %s: want %s got %s", tc.cfg.NodeName, r, want, got.String())
		}
		alloc := Allocatable(capacity, tc.cfg.Reserved)
		got := alloc[corev1.ResourceMemory]
		assert.Zero(t, q(tc.allocatableMemory).Cmp(got), "%s allocatable memory: got %s", tc.cfg.NodeName, got.String())
		f := facts(tc.cfg)
		l := Labels(f)
		assert.Equal(t, tc.arch, l[corev1.LabelArchStable])
		assert.Equal(t, tc.cfg.NodeName, l[corev1.LabelHostname])
		assert.Equal(t, tc.arch, NodeInfo(f).Architecture)
	}
	assert.Equal(t, "n1-"+foreign, g.NodeName)
	assert.Equal(t, "emulated", Labels(facts(g))["pool"])
	assert.Empty(t, Labels(facts(main))["pool"])
}
