package provider

import (
	"path/filepath"
	"testing"

	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/podtest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
)

// TestVMSpecCPUModel: a pod's cpu-model annotation reaches its VM's -cpu
// over the node's cpuModel, which reaches it over qemu's default; host on
// a TCG node fails the spec's validation (prepareRun makes that an
// InvalidSpec: InvalidVMSpec, not a start error). vmSpec is pure.
func TestVMSpecCPUModel(t *testing.T) {
	cases := []struct {
		name    string
		node    map[qemu.Accelerator]string
		pod     string // the annotation; "": none
		want    string // -cpu
		invalid bool
	}{
		{name: "default", want: qemu.DefaultCPUModel(qemu.ArchX86_64, qemu.AccelTCG)},
		{name: "node's", node: map[qemu.Accelerator]string{qemu.AccelTCG: "max", qemu.AccelKVM: "host"}, want: "max"},
		{name: "pod's over node's", node: map[qemu.Accelerator]string{qemu.AccelTCG: "max"}, pod: "Haswell-v4,-hle", want: "Haswell-v4,-hle"},
		{name: "pod's host under tcg", pod: "host", invalid: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			imageDir := filepath.Join(dir, "images")
			node := nodeVMSettings{arch: qemu.ArchX86_64, accelerator: "tcg", imageDir: imageDir, cpuModels: tc.node}
			img := &oci.Image{Ref: "r/os:1", Digest: "sha256:x", Kernel: filepath.Join(imageDir, "k", "vmlinuz")}
			pod := podtest.VMPod(func(p *corev1.Pod) {
				if tc.pod != "" {
					p.Annotations = map[string]string{podspec.AnnotationCPUModel: tc.pod}
				}
			})
			plan, rej := podspec.Translate(pod, qemu.ArchX86_64)
			require.Nil(t, rej)
			spec, err := vmSpec(vmRun{name: "default.vm", dir: filepath.Join(dir, "pod"), plan: plan}, img, node)
			require.NoError(t, err)
			if tc.invalid {
				err := spec.Validate()
				require.Error(t, err)
				assert.Contains(t, err.Error(), `cpu model "host": host needs accelerator kvm`)
				return
			}
			args := qemu.Args(spec)
			i := indexOf(args, "-cpu")
			require.GreaterOrEqual(t, i, 0, "no -cpu in %v", args)
			assert.Equal(t, tc.want, args[i+1])
		})
	}
}

func indexOf(s []string, v string) int {
	for i, e := range s {
		if e == v {
			return i
		}
	}
	return -1
}
