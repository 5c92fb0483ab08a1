package podspec

import (
	"testing"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/podtest"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

func TestTranslateAccepts(t *testing.T) {
	cases := []struct {
		name string
		pod  *corev1.Pod
		want Plan
	}{
		{"defaults", podtest.VMPod(), Plan{Image: "127.0.0.1:5000/os/tiny:1", PullPolicy: oci.PullIfNotPresent, CPUs: 1, MemoryMiB: 512, Machine: "q35", Firmware: qemu.FirmwareBIOS}},
		{"limits win, cpu rounded up", podtest.VMPod(func(p *corev1.Pod) {
			p.Spec.Containers[0].Resources = corev1.ResourceRequirements{Limits: podtest.RL("cpu", "1500m", "memory", "1Gi"), Requests: podtest.RL("cpu", "100m", "memory", "128Mi")}
		}), Plan{Image: "127.0.0.1:5000/os/tiny:1", PullPolicy: oci.PullIfNotPresent, CPUs: 2, MemoryMiB: 1024, CPULimitMilli: 1500, Machine: "q35", Firmware: qemu.FirmwareBIOS}},
		{"requests when no limits", podtest.VMPod(func(p *corev1.Pod) {
			p.Spec.Containers[0].Resources = corev1.ResourceRequirements{Requests: podtest.RL("cpu", "3", "memory", "300M")}
		}), Plan{Image: "127.0.0.1:5000/os/tiny:1", PullPolicy: oci.PullIfNotPresent, CPUs: 3, MemoryMiB: 287, Machine: "q35", Firmware: qemu.FirmwareBIOS}},
		{"pull policy, secrets, annotations", podtest.VMPod(func(p *corev1.Pod) {
			p.Spec.Containers[0].ImagePullPolicy = corev1.PullAlways
			p.Spec.ImagePullSecrets = []corev1.LocalObjectReference{{Name: "reg"}, {Name: "reg2"}}
			p.Annotations = map[string]string{
				AnnotationMachine: "microvm", AnnotationKernelCmdline: " quiet loglevel=3 ", AnnotationRequireAccelerator: "kvm",
				"other.example/x": "ignored", "kubectl.kubernetes.io/last-applied-configuration": "{}",
			}
		}), Plan{Image: "127.0.0.1:5000/os/tiny:1", PullPolicy: oci.PullAlways, PullSecrets: []string{"reg", "reg2"}, CPUs: 1, MemoryMiB: 512,
			Machine: "microvm", Firmware: qemu.FirmwareBIOS, ExtraCmdline: "quiet loglevel=3", Accelerator: "kvm"}},
		{"ExporterSet controller annotations (parameters, reclaim policy, removal mark)", podtest.VMPod(func(p *corev1.Pod) {
			p.Annotations = map[string]string{v1alpha1.ParametersAnnotation: `{"a":1}`, v1alpha1.ReclaimPolicyAnnotation: "Retain", v1alpha1.RemoveAnnotation: "true"}
		}), Plan{Image: "127.0.0.1:5000/os/tiny:1", PullPolicy: oci.PullIfNotPresent, CPUs: 1, MemoryMiB: 512, Machine: "q35", Firmware: qemu.FirmwareBIOS}},
		{"state policy Retain", podtest.VMPod(func(p *corev1.Pod) {
			p.Annotations = map[string]string{v1alpha1.StatePolicyAnnotation: "Retain", v1alpha1.ReclaimPolicyAnnotation: "Delete"}
		}), Plan{Image: "127.0.0.1:5000/os/tiny:1", PullPolicy: oci.PullIfNotPresent, CPUs: 1, MemoryMiB: 512, Machine: "q35", Firmware: qemu.FirmwareBIOS,
			StatePolicy: v1alpha1.StatePolicyRetain}},
		{"state policy Disabled", podtest.VMPod(func(p *corev1.Pod) {
			p.Annotations = map[string]string{v1alpha1.StatePolicyAnnotation: "Disabled"}
		}), Plan{Image: "127.0.0.1:5000/os/tiny:1", PullPolicy: oci.PullIfNotPresent, CPUs: 1, MemoryMiB: 512, Machine: "q35", Firmware: qemu.FirmwareBIOS,
			StatePolicy: v1alpha1.StatePolicyDisabled}},
		{"never, uefi, any", podtest.VMPod(func(p *corev1.Pod) {
			p.Spec.Containers[0].ImagePullPolicy = corev1.PullNever
			p.Annotations = map[string]string{AnnotationFirmware: "uefi", AnnotationRequireAccelerator: "any"}
			p.Spec.Containers[0].Ports = []corev1.ContainerPort{{ContainerPort: 22}}
		}), Plan{Image: "127.0.0.1:5000/os/tiny:1", PullPolicy: oci.PullNever, CPUs: 1, MemoryMiB: 512, Machine: "q35", Firmware: qemu.FirmwareUEFI}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, rej := Translate(tc.pod, qemu.ArchX86_64)
			require.Nil(t, rej)
			assert.Equal(t, tc.want, got)
		})
	}
}

func TestTranslateRejects(t *testing.T) {
	yes := true
	cases := []struct {
		name string
		mut  func(*corev1.Pod)
		want []string // substrings of the message
	}{
		{"two containers", func(p *corev1.Pod) {
			p.Spec.Containers = append(p.Spec.Containers, corev1.Container{Name: "side", Image: "x"})
		},
			[]string{"spec.containers: a VM pod has exactly one container", "got 2"}},
		{"init containers", func(p *corev1.Pod) { p.Spec.InitContainers = []corev1.Container{{Name: "i", Image: "x"}} }, []string{"spec.initContainers: not supported"}},
		{"host namespaces", func(p *corev1.Pod) { p.Spec.HostNetwork, p.Spec.HostPID, p.Spec.HostIPC = true, true, true },
			[]string{"spec.hostNetwork", "spec.hostPID", "spec.hostIPC"}},
		{"privileged", func(p *corev1.Pod) { p.Spec.Containers[0].SecurityContext = &corev1.SecurityContext{Privileged: &yes} },
			[]string{"spec.containers[0].securityContext.privileged: not supported"}},
		{"pvc", func(p *corev1.Pod) {
			p.Spec.Volumes = append(p.Spec.Volumes, corev1.Volume{Name: "data", VolumeSource: corev1.VolumeSource{PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: "c"}}})
		}, []string{"spec.volumes[1].persistentVolumeClaim", `volume "data"`}},
		{"guest disk volumes that cannot be disks", func(p *corev1.Pod) {
			p.Spec.Volumes = []corev1.Volume{
				{Name: "s", VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{SecretName: "s"}}},
				{Name: "much-too-long-name", VolumeSource: corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{}}},
				{Name: "e", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}},
			}
		}, []string{"spec.volumes[1].name: volume \"much-too-long-name\"", "spec.volumes[2].emptyDir.sizeLimit"}},
		{"other projected volume", func(p *corev1.Pod) {
			p.Spec.Volumes = []corev1.Volume{{Name: "tokens", VolumeSource: corev1.VolumeSource{Projected: &corev1.ProjectedVolumeSource{}}}}
		}, []string{"spec.volumes[0]: volume \"tokens\""}},
		{"unknown project annotation", func(p *corev1.Pod) { p.Annotations = map[string]string{"qemu-kubelet.io/cpus": "2"} },
			[]string{"metadata.annotations[qemu-kubelet.io/cpus]: unknown qemu-kubelet annotation", "qemu-kubelet.io/machine"}},
		{"bad annotation values", func(p *corev1.Pod) {
			p.Annotations = map[string]string{AnnotationMachine: "virt", AnnotationFirmware: "coreboot", AnnotationRequireAccelerator: "hvf", AnnotationKernelCmdline: "a\nb"}
		}, []string{`machine "virt": not a machine of this node's x86_64 guests (want q35, pc, microvm)`, `firmware "coreboot"`, `accelerator "hvf"`, "one line"}},
		{"bad lease state policy and hooks", func(p *corev1.Pod) {
			p.Annotations = map[string]string{v1alpha1.LeaseStatePolicyAnnotation: "Forget", v1alpha1.LeaseHooksAnnotation: `{"afterLease":{"actions":[{"action":"rm"}]}}`}
		}, []string{`metadata.annotations[qemu-kubelet.io/lease-state-policy]`, `lease state policy "Forget": want Reset or Keep`,
			`metadata.annotations[qemu-kubelet.io/lease-hooks]`, `action "rm"`}},
		{"bad state and reclaim policies", func(p *corev1.Pod) {
			p.Annotations = map[string]string{v1alpha1.StatePolicyAnnotation: "retain", v1alpha1.ReclaimPolicyAnnotation: "Keep"}
		}, []string{`metadata.annotations[qemu-kubelet.io/state-policy]: state policy "retain": want Disabled or Retain`,
			`metadata.annotations[qemu-kubelet.io/reclaim-policy]: reclaim policy "Keep": want Delete or Retain`}},
		{"microvm uefi", func(p *corev1.Pod) {
			p.Annotations = map[string]string{AnnotationMachine: "microvm", AnnotationFirmware: "uefi"}
		},
			[]string{"uefi is not available with machine microvm"}},
		{"command args env", func(p *corev1.Pod) {
			c := &p.Spec.Containers[0]
			c.Command, c.Args = []string{"sh"}, []string{"-c"}
			c.Env = []corev1.EnvVar{{Name: "A", Value: "b"}, {Name: "R", ValueFrom: &corev1.EnvVarSource{ResourceFieldRef: &corev1.ResourceFieldSelector{Resource: "limits.cpu"}}}}
		}, []string{"spec.containers[0].command", "spec.containers[0].args", "spec.containers[0].env[1].valueFrom: env \"R\""}},
		{"gpu and hostPort", func(p *corev1.Pod) {
			p.Spec.Containers[0].Resources.Limits = podtest.RL("nvidia.com/gpu", "1")
			p.Spec.Containers[0].Ports = []corev1.ContainerPort{{ContainerPort: 22, HostPort: 2222}}
		}, []string{"resources.limits[nvidia.com/gpu]", "ports[0].hostPort"}},
		{"no image", func(p *corev1.Pod) { p.Spec.Containers[0].Image = "" }, []string{"spec.containers[0].image"}},
		{"negative and huge resources (found by FuzzTranslate)", func(p *corev1.Pod) {
			p.Spec.Containers[0].Resources = corev1.ResourceRequirements{Requests: podtest.RL("cpu", "-2", "memory", "-1Gi"), Limits: podtest.RL("cpu", "5000", "memory", "1Ei")}
		}, []string{"resources.requests[cpu]: -2 must not be negative", "resources.requests[memory]: -1Gi must not be negative",
			"resources.limits[cpu]: 5k is more than a VM can have", "resources.limits[memory]: 1Ei is more than a VM can have"}},
		{"exec liveness probe without a command", func(p *corev1.Pod) {
			p.Spec.Containers[0].LivenessProbe = &corev1.Probe{ProbeHandler: corev1.ProbeHandler{Exec: &corev1.ExecAction{}}}
		}, []string{"spec.containers[0].livenessProbe.exec.command: an exec probe needs a command"}},
		{"grpc startup probe beside an exec readiness probe", func(p *corev1.Pod) {
			p.Spec.Containers[0].ReadinessProbe = &corev1.Probe{ProbeHandler: corev1.ProbeHandler{Exec: &corev1.ExecAction{Command: []string{"true"}}}}
			p.Spec.Containers[0].StartupProbe = &corev1.Probe{ProbeHandler: corev1.ProbeHandler{GRPC: &corev1.GRPCAction{Port: 9000}}}
		}, []string{"spec.containers[0].startupProbe.grpc: grpc probes are not supported"}},
		{"grpc liveness probe", func(p *corev1.Pod) {
			p.Spec.Containers[0].LivenessProbe = &corev1.Probe{ProbeHandler: corev1.ProbeHandler{GRPC: &corev1.GRPCAction{Port: 9000}}}
		}, []string{"spec.containers[0].livenessProbe.grpc"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, rej := Translate(podtest.VMPod(tc.mut), qemu.ArchX86_64)
			require.NotNil(t, rej)
			assert.Equal(t, ReasonUnsupportedPodSpec, rej.Reason)
			for _, w := range tc.want {
				assert.Contains(t, rej.Message, w)
			}
		})
	}
}

// TestTranslateArch: the machine type follows the node's guest
// architecture: virt is the aarch64 default, x86 machines are refused there.
func TestTranslateArch(t *testing.T) {
	plan, rej := Translate(podtest.VMPod(), qemu.ArchAArch64)
	require.Nil(t, rej)
	assert.Equal(t, "virt", plan.Machine)
	plan, rej = Translate(podtest.VMPod(func(p *corev1.Pod) {
		p.Annotations = map[string]string{AnnotationMachine: "virt", AnnotationFirmware: "uefi"}
	}), qemu.ArchAArch64)
	require.Nil(t, rej)
	assert.Equal(t, "virt", plan.Machine)
	assert.Equal(t, qemu.FirmwareUEFI, plan.Firmware)
	for _, m := range []string{"q35", "pc", "microvm"} {
		_, rej := Translate(podtest.VMPod(func(p *corev1.Pod) { p.Annotations = map[string]string{AnnotationMachine: m} }), qemu.ArchAArch64)
		require.NotNil(t, rej, m)
		assert.Contains(t, rej.Message, `machine "`+m+`": not a machine of this node's aarch64 guests (want virt)`)
	}
	plan, rej = Translate(podtest.VMPod(), qemu.ArchX86_64)
	require.Nil(t, rej)
	assert.Equal(t, "q35", plan.Machine)
}

// Exec probes run through the guest agent every VM has a channel for:
// admitted.
func TestTranslateAdmitsExecProbes(t *testing.T) {
	exec := &corev1.Probe{ProbeHandler: corev1.ProbeHandler{Exec: &corev1.ExecAction{Command: []string{"test", "-e", "/tmp/ready"}}}}
	_, rej := Translate(podtest.VMPod(func(p *corev1.Pod) {
		p.Spec.Containers[0].LivenessProbe = exec
		p.Spec.Containers[0].ReadinessProbe = exec
		p.Spec.Containers[0].StartupProbe = exec
	}), qemu.ArchX86_64)
	assert.Nil(t, rej)
}

// TestVMCgroup: mode Inherit (nil base) gives no cgroup; mode Own caps the
// VM at the pod's CPU limit and at the guest's RAM plus the node's
// overhead (what admission counted).
func TestVMCgroup(t *testing.T) {
	assert.Nil(t, VMCgroup(nil, 500, 256, 128<<20))
	base := &qemu.Cgroup{Root: "/sys/fs/cgroup", Parent: "qemu-kubelet"}
	got := VMCgroup(base, 500, 256, 128<<20)
	assert.Equal(t, &qemu.Cgroup{Root: "/sys/fs/cgroup", Parent: "qemu-kubelet", CPUMilli: 500, MemoryMaxBytes: 384 << 20}, got)
	assert.Equal(t, int64(0), base.CPUMilli, "the node's base is not modified")
	got = VMCgroup(base, 0, 512, 0)
	assert.Equal(t, &qemu.Cgroup{Root: "/sys/fs/cgroup", Parent: "qemu-kubelet"}, got, "no CPU limit, no overhead: no caps")
	cpuOnly := &qemu.Cgroup{Root: "/sys/fs/cgroup", Parent: "qemu-kubelet", CPUOnly: true, ParentCPUWeight: 50}
	got = VMCgroup(cpuOnly, 500, 256, 128<<20)
	assert.Equal(t, cpuOnly, got, "a CPU-only cgroup (mode Inherit) gets no limits: the agent's cgroup had none")
	assert.NotSame(t, cpuOnly, got, "a copy of the node's base")
}

func TestTranslateSnapshotStart(t *testing.T) {
	pod := func(mut func(*corev1.Pod)) *corev1.Pod {
		p := podtest.VMPod(func(p *corev1.Pod) {
			p.Annotations = map[string]string{AnnotationStartFromSnapshot: "true"}
			p.Spec.RestartPolicy = corev1.RestartPolicyAlways
		})
		p.Spec.Containers[0].ReadinessProbe = &corev1.Probe{ProbeHandler: corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Port: intstr.FromInt32(22)}}}
		if mut != nil {
			mut(p)
		}
		return p
	}
	plan, rej := Translate(pod(nil), qemu.ArchX86_64)
	require.Nil(t, rej)
	assert.True(t, plan.SnapshotStart)
	plan, rej = Translate(pod(func(p *corev1.Pod) { p.Annotations[AnnotationStartFromSnapshot] = "false" }), qemu.ArchX86_64)
	require.Nil(t, rej)
	assert.False(t, plan.SnapshotStart)

	_, rej = Translate(pod(func(p *corev1.Pod) { p.Annotations[AnnotationStartFromSnapshot] = "yes" }), qemu.ArchX86_64)
	require.NotNil(t, rej)
	assert.Contains(t, rej.Message, `"yes": want "true" or "false"`)
	_, rej = Translate(pod(func(p *corev1.Pod) { p.Spec.Containers[0].ReadinessProbe = nil }), qemu.ArchX86_64)
	require.NotNil(t, rej)
	assert.Contains(t, rej.Message, "needs a readinessProbe")
	_, rej = Translate(pod(func(p *corev1.Pod) {
		p.Spec.Volumes = []corev1.Volume{{Name: "cfg", VolumeSource: corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{LocalObjectReference: corev1.LocalObjectReference{Name: "c"}}}}}
	}), qemu.ArchX86_64)
	require.NotNil(t, rej)
	assert.Contains(t, rej.Message, `not with volume "cfg"`)
	_, rej = Translate(pod(func(p *corev1.Pod) { p.Spec.Containers[0].Env = []corev1.EnvVar{{Name: "A", Value: "b"}} }), qemu.ArchX86_64)
	require.NotNil(t, rej)
	assert.Contains(t, rej.Message, "not with env or envFrom")
	// The exporter's Secret volume stays on the host: allowed.
	plan, rej = Translate(pod(func(p *corev1.Pod) {
		p.Annotations["qemu-kubelet.io/jumpstarter-exporter-secret"] = "js"
		p.Spec.Volumes = []corev1.Volume{{Name: "js", VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{SecretName: "js"}}}}
	}), qemu.ArchX86_64)
	require.Nil(t, rej)
	assert.True(t, plan.SnapshotStart)
}

// TestTranslateRetainWithSnapshotStart: a memory snapshot restores the
// guest with the image's disk, so state policy Retain and snapshot start
// are refused together; each alone is fine.
func TestTranslateRetainWithSnapshotStart(t *testing.T) {
	pod := func(ann map[string]string) *corev1.Pod {
		p := podtest.VMPod(func(p *corev1.Pod) {
			p.Annotations = ann
			p.Spec.RestartPolicy = corev1.RestartPolicyAlways
		})
		p.Spec.Containers[0].ReadinessProbe = &corev1.Probe{ProbeHandler: corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Port: intstr.FromInt32(22)}}}
		return p
	}
	_, rej := Translate(pod(map[string]string{AnnotationStartFromSnapshot: "true", v1alpha1.StatePolicyAnnotation: "Retain"}), qemu.ArchX86_64)
	require.NotNil(t, rej)
	assert.Equal(t, ReasonUnsupportedPodSpec, rej.Reason)
	assert.Contains(t, rej.Message, "metadata.annotations[qemu-kubelet.io/state-policy]: Retain cannot be combined with qemu-kubelet.io/start-from-snapshot")
	for _, ann := range []map[string]string{
		{AnnotationStartFromSnapshot: "true", v1alpha1.StatePolicyAnnotation: "Disabled"},
		{AnnotationStartFromSnapshot: "false", v1alpha1.StatePolicyAnnotation: "Retain"},
	} {
		_, rej := Translate(pod(ann), qemu.ArchX86_64)
		assert.Nil(t, rej, "%v", ann)
	}
}
