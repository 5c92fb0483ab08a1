package provider

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/oci/ocitest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/vmtest"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
)

// TestUEFIPodBoots: a pod annotated qemu-kubelet.io/firmware=uefi on a node
// whose OVMF is the one node config finds by default (Debian's ovmf) boots
// the test kernel through OVMF under real QEMU (TCG), with its own copy of
// the UEFI variable store, and stops when deleted.
func TestUEFIPodBoots(t *testing.T) {
	root := t.TempDir()
	vmtest.ReapQEMU(t, root)
	var code, vars string
	for _, pair := range config.DefaultOVMF {
		if _, err := os.Stat(pair[0]); err == nil {
			if _, err := os.Stat(pair[1]); err == nil {
				code, vars = pair[0], pair[1]
				break
			}
		}
	}
	if code == "" {
		t.Fatalf("no OVMF pair of %v installed (hack/install-deps.sh installs ovmf)", config.DefaultOVMF)
	}
	reg := ocitest.StartRegistry(t, ocitest.RegistryOptions{})
	refs := vmtest.PushTestImages(t, reg.Addr)
	imageDir := filepath.Join(root, "images")
	store, err := oci.Open(imageDir, oci.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { store.Close() })
	stateDir := filepath.Join(root, "state")
	h := newHarness(t, stateDir, store, imageDir)
	h.vms.cfg.UEFICode, h.vms.cfg.UEFIVars = code, vars
	ctx := context.Background()

	pod := podFor("u-uefi", refs[vmtest.VariantACPI], corev1.RestartPolicyNever, map[string]string{podspec.AnnotationFirmware: "uefi"})
	require.NoError(t, h.vms.CreatePod(ctx, pod))
	h.wait(pod.UID, 120*time.Second, "Running", running)
	dir := filepath.Join(stateDir, VMsDirName, "u-uefi")
	waitConsole(t, dir, vmtest.BootMarker, 180*time.Second)
	fi, err := os.Stat(filepath.Join(dir, qemu.UEFIVarsName))
	require.NoError(t, err, "the VM's private UEFI vars")
	require.NotZero(t, fi.Size())
	require.NoError(t, h.vms.DeletePod(ctx, deleting(pod)))
	h.wait(pod.UID, 90*time.Second, "terminated", func(p *corev1.Pod) bool { return terminated(p) != nil })
	waitGoneDir(t, dir, 30*time.Second)
}
