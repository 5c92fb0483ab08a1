package podspec

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/podtest"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	corev1 "k8s.io/api/core/v1"
)

// FuzzTranslate: any pod (as JSON) is translated or refused with an
// UnsupportedPodSpec naming why, never a panic; an accepted plan is one a
// VM can run (an image, at least one vCPU and 1 MiB, a known machine and
// firmware, a one-line command line), and its kernel command line names a
// console.
func FuzzTranslate(f *testing.F) {
	seed := func(mut func(*corev1.Pod)) {
		b, err := json.Marshal(podtest.VMPod(mut))
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	seed(func(*corev1.Pod) {})
	seed(func(p *corev1.Pod) {
		p.Spec.Containers[0].Resources.Limits = podtest.RL("cpu", "1500m", "memory", "1Gi")
		p.Annotations = map[string]string{AnnotationMachine: "microvm", AnnotationKernelCmdline: "quiet"}
	})
	seed(func(p *corev1.Pod) {
		p.Annotations = map[string]string{AnnotationFirmware: "uefi", AnnotationRequireAccelerator: "kvm"}
		p.Spec.Containers[0].ReadinessProbe = &corev1.Probe{ProbeHandler: corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{}}}
	})
	seed(func(p *corev1.Pod) {
		p.Spec.Volumes = append(p.Spec.Volumes, corev1.Volume{Name: "d", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}})
		p.Spec.Containers[0].Env = []corev1.EnvVar{{Name: "A", Value: "b"}}
	})
	seed(func(p *corev1.Pod) {
		p.Spec.Containers[0].Resources.Requests = podtest.RL("memory", "-1Gi", "cpu", "-2")
	})
	f.Fuzz(func(t *testing.T, data []byte) {
		var pod corev1.Pod
		if json.Unmarshal(data, &pod) != nil {
			return
		}
		plan, rej := Translate(&pod, qemu.ArchX86_64)
		if rej != nil {
			if rej.Reason != ReasonUnsupportedPodSpec || rej.Message == "" {
				t.Fatalf("rejection %+v", rej)
			}
			return
		}
		switch {
		case plan.Image == "":
			t.Fatal("accepted without an image")
		case plan.CPUs < 1:
			t.Fatalf("accepted with %d vCPUs", plan.CPUs)
		case plan.MemoryMiB < 1:
			t.Fatalf("accepted with %d MiB", plan.MemoryMiB)
		case plan.Machine != "q35" && plan.Machine != "pc" && plan.Machine != "microvm":
			t.Fatalf("machine %q", plan.Machine)
		case plan.Firmware != qemu.FirmwareBIOS && plan.Firmware != qemu.FirmwareUEFI:
			t.Fatalf("firmware %q", plan.Firmware)
		case strings.ContainsAny(plan.ExtraCmdline, "\n\r\x00") || len(plan.ExtraCmdline) > MaxKernelCmdlineAnnotation:
			t.Fatalf("command line %q", plan.ExtraCmdline)
		}
		if !hasConsoleArg(KernelCmdline(qemu.ArchX86_64, "quiet", plan.ExtraCmdline)) {
			t.Fatalf("no console in %q", KernelCmdline(qemu.ArchX86_64, "quiet", plan.ExtraCmdline))
		}
	})
}
