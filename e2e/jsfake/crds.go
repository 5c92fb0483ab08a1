package jsfake

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/qemu-kubelet/qemu-kubelet/e2e/cluster"
)

// Jumpstarter's resources, for dynamic clients.
var (
	ExporterGVR = schema.GroupVersionResource{Group: "jumpstarter.dev", Version: "v1alpha1", Resource: "exporters"}
	LeaseGVR    = schema.GroupVersionResource{Group: "jumpstarter.dev", Version: "v1alpha1", Resource: "leases"}
)

// CRDDir is where Jumpstarter's CRDs are: $QK_JUMPSTARTER_CRDS, else
// shared/jumpstarter/crds beside the repository (upstream's generated
// CRDs, data only).
func CRDDir() (string, error) {
	dir := os.Getenv("QK_JUMPSTARTER_CRDS")
	if dir == "" {
		root, err := cluster.RepoRoot()
		if err != nil {
			return "", err
		}
		dir = filepath.Join(root, "..", "shared", "jumpstarter", "crds")
	}
	if _, err := os.Stat(filepath.Join(dir, "jumpstarter.dev_exporters.yaml")); err != nil {
		return "", fmt.Errorf("jumpstarter CRDs not found (%s; set QK_JUMPSTARTER_CRDS): %w", dir, err)
	}
	return dir, nil
}

// InstallCRDs applies Jumpstarter's CRDs to c and waits until they are
// established.
func InstallCRDs(ctx context.Context, c *cluster.Cluster) error {
	dir, err := CRDDir()
	if err != nil {
		return err
	}
	if out, err := c.Kubectl(ctx, "apply", "--server-side", "-f", dir); err != nil {
		return fmt.Errorf("install jumpstarter CRDs: %w: %s", err, out)
	}
	if out, err := c.Kubectl(ctx, "wait", "--for=condition=Established", "--timeout=60s",
		"crd/exporters.jumpstarter.dev", "crd/leases.jumpstarter.dev", "crd/clients.jumpstarter.dev"); err != nil {
		return fmt.Errorf("wait for jumpstarter CRDs: %w: %s", err, out)
	}
	return nil
}
