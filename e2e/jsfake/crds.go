package jsfake

import (
	"context"
	"fmt"

	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/qemu-kubelet/qemu-kubelet/e2e/cluster"
	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
)

// Jumpstarter's resources, for dynamic clients.
var (
	ExporterGVR = schema.GroupVersionResource{Group: "jumpstarter.dev", Version: "v1alpha1", Resource: "exporters"}
	LeaseGVR    = schema.GroupVersionResource{Group: "jumpstarter.dev", Version: "v1alpha1", Resource: "leases"}
)

// InstallCRDs applies the tests' Jumpstarter CRDs (Exporters and Leases,
// generated from the project's api/jumpstarter/v1alpha1:
// testutil.JumpstarterCRDs) to c and waits until they are established.
func InstallCRDs(ctx context.Context, c *cluster.Cluster) error {
	root, err := cluster.RepoRoot()
	if err != nil {
		return err
	}
	if out, err := c.Kubectl(ctx, "apply", "--server-side", "-f", testutil.JumpstarterCRDs(root)); err != nil {
		return fmt.Errorf("install jumpstarter CRDs: %w: %s", err, out)
	}
	if out, err := c.Kubectl(ctx, "wait", "--for=condition=Established", "--timeout=60s",
		"crd/exporters.jumpstarter.dev", "crd/leases.jumpstarter.dev"); err != nil {
		return fmt.Errorf("wait for jumpstarter CRDs: %w: %s", err, out)
	}
	return nil
}
