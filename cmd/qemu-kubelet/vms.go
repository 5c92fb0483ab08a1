package main

import (
	"context"
	"fmt"
	"path/filepath"

	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/provider"
	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
)

// imageDirName is the image cache under the state dir.
const imageDirName = "images"

// openImages opens the node's image cache.
func openImages(ctx context.Context, cfg *config.Node) (*oci.Store, string, error) {
	dir := filepath.Join(cfg.StateDir, imageDirName)
	s, err := oci.Open(dir, oci.Options{Logger: klog.FromContext(ctx)})
	if err != nil {
		return nil, "", fmt.Errorf("image cache: %w", err)
	}
	return s, dir, nil
}

// newVMs builds the VM pod handler and re-adopts the VMs of the state dir.
func newVMs(ctx context.Context, cfg *config.Node, facts provider.Facts, client kubernetes.Interface, images *oci.Store, imageDir string, allocatable func() corev1.ResourceList) (*provider.VMs, error) {
	vms := provider.NewVMs(ctx, provider.VMsConfig{
		NodeName:    cfg.NodeName,
		NodeIP:      cfg.NodeIP,
		StateDir:    cfg.StateDir,
		QEMUBinary:  cfg.QEMUBinary,
		Accelerator: facts.Accelerator.Name,
		Images:      images,
		ImageDir:    imageDir,
		Allocatable: allocatable,
		Secrets: func(ctx context.Context, ns, name string) (*corev1.Secret, error) {
			return client.CoreV1().Secrets(ns).Get(ctx, name, metav1.GetOptions{})
		},
		ForceDelete: func(ctx context.Context, ns, name string, uid types.UID) error {
			zero := int64(0)
			return client.CoreV1().Pods(ns).Delete(ctx, name, metav1.DeleteOptions{
				GracePeriodSeconds: &zero,
				Preconditions:      metav1.NewUIDPreconditions(string(uid)),
			})
		},
	})
	res, err := vms.Recover(ctx)
	if err != nil {
		return nil, err
	}
	klog.FromContext(ctx).Info("Recovered VMs from the state dir", "running", res.Running, "exited", res.Exited, "pending", res.Pending, "orphansRemoved", res.Orphans)
	return vms, nil
}
