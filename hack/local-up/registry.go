package main

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/qemu-kubelet/qemu-kubelet/e2e/cluster"
)

// registryAddr is where config/samples/exporterset.yaml expects the test OS
// image: 127.0.0.1:5000/qemu-kubelet/test-os:latest.
const (
	registryAddr = "127.0.0.1:5000"
	testImageRef = registryAddr + "/qemu-kubelet/test-os:latest"
)

// startRegistry runs the Debian docker-registry on registryAddr with its
// storage under the cluster dir.
func startRegistry(c *cluster.Cluster) (*exec.Cmd, error) {
	if l, err := net.Listen("tcp", registryAddr); err != nil {
		return nil, fmt.Errorf("registry: %s is busy (the sample ExporterSet's image points there): %w", registryAddr, err)
	} else {
		l.Close()
	}
	dir := filepath.Join(c.Dir(), "registry")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	cfg := fmt.Sprintf("version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: %s\n  delete:\n    enabled: true\nhttp:\n  addr: %s\n", filepath.Join(dir, "storage"), registryAddr)
	cfgPath := filepath.Join(dir, "config.yml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		return nil, err
	}
	cmd, err := spawn(c, "/usr/bin/docker-registry", "registry", "serve", cfgPath)
	if err != nil {
		return nil, fmt.Errorf("%w (install docker-registry: hack/install-deps.sh)", err)
	}
	err = wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, 20*time.Second, true, func(context.Context) (bool, error) {
		resp, err := http.Get("http://" + registryAddr + "/v2/")
		if err != nil {
			return false, nil
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK, nil
	})
	if err != nil {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		return nil, fmt.Errorf("registry on %s not ready (see %s): %w", registryAddr, filepath.Join(c.Dir(), "logs", "registry.log"), err)
	}
	return cmd, nil
}

// pushTestImage builds the test OS image and oras (both cached) and pushes
// the ACPI variant (kernel + initrd + cmdline) as testImageRef.
func pushTestImage(ctx context.Context, root, workDir string) error {
	out := func(script string) (string, error) {
		cmd := exec.CommandContext(ctx, filepath.Join(root, "hack", script))
		cmd.Stderr = os.Stderr
		b, err := cmd.Output()
		if err != nil {
			return "", fmt.Errorf("hack/%s: %w", script, err)
		}
		lines := strings.Split(strings.TrimSpace(string(b)), "\n")
		return strings.TrimSpace(lines[len(lines)-1]), nil
	}
	imgDir, err := out("build-test-image.sh")
	if err != nil {
		return err
	}
	oras, err := out("build-oras.sh")
	if err != nil {
		return err
	}
	// oras names layers after the files as given: link them into one dir.
	dir := filepath.Join(workDir, "test-os")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	files := map[string]string{"vmlinuz": "vmlinuz", "initramfs.cpio.gz": "initramfs-acpi.cpio.gz", "cmdline": "cmdline"}
	for link, src := range files {
		_ = os.Remove(filepath.Join(dir, link))
		if err := os.Symlink(filepath.Join(imgDir, src), filepath.Join(dir, link)); err != nil {
			return err
		}
	}
	cmd := exec.CommandContext(ctx, oras, "push", "--plain-http", "--artifact-type", "application/vnd.qemu-kubelet.os-image.v1",
		testImageRef, "vmlinuz", "initramfs.cpio.gz", "cmdline")
	cmd.Dir = dir
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("oras push %s: %w\n%s", testImageRef, err, b)
	}
	return nil
}

// kubectlRunLine is a one-liner that boots a VM from the test image on the
// virtual node.
func kubectlRunLine() string {
	return `kubectl run vm1 --image=` + testImageRef + ` --restart=Never --overrides='{"spec":{"nodeSelector":{"type":"virtual-kubelet"},"tolerations":[{"key":"virtual-kubelet.io/provider","operator":"Equal","value":"qemu","effect":"NoSchedule"}]}}'`
}

// stopVMs deletes the ExporterSets and pods and waits (bounded) until no
// QEMU runs under stateDir; whatever is left is killed.
func stopVMs(c *cluster.Cluster, stateDir string) {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	fmt.Println("local-up: deleting pods so their VMs stop...")
	_, _ = c.Kubectl(ctx, "delete", "exportersets", "--all", "--all-namespaces", "--wait=false")
	_ = c.Client().CoreV1().Pods(metav1.NamespaceAll).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{})
	nss, err := c.Client().CoreV1().Namespaces().List(ctx, metav1.ListOptions{})
	if err == nil {
		for _, ns := range nss.Items {
			_ = c.Client().CoreV1().Pods(ns.Name).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{})
		}
	}
	_ = wait.PollUntilContextCancel(ctx, 500*time.Millisecond, true, func(context.Context) (bool, error) {
		return len(qemuPids(stateDir)) == 0, nil
	})
	for _, pid := range qemuPids(stateDir) {
		fmt.Printf("local-up: killing leftover QEMU %d\n", pid)
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
}

// qemuPids lists qemu-system processes whose command line mentions dir.
func qemuPids(dir string) []int {
	ents, _ := os.ReadDir("/proc")
	var out []int
	for _, e := range ents {
		var pid int
		if _, err := fmt.Sscan(e.Name(), &pid); err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil || !strings.Contains(string(b), "qemu-system") || !strings.Contains(string(b), dir) {
			continue
		}
		out = append(out, pid)
	}
	return out
}
