package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/provider"
	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"github.com/qemu-kubelet/qemu-kubelet/provider/exporter"
	"github.com/qemu-kubelet/qemu-kubelet/provider/nodestatus"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/provider/telemetry"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
)

// imageDirName is the image cache under the state dir.
const imageDirName = "images"

// openImages opens the node's image cache. Multi-platform images (OCI
// indexes) resolve to the node's guest architecture: linux/arm64 on an
// arm64 guest node, whatever the host.
func openImages(ctx context.Context, cfg *config.Node) (*oci.Store, string, error) {
	dir := filepath.Join(cfg.StateDir, imageDirName)
	regs := map[string]oci.RegistryConfig{}
	for host, r := range cfg.Images.Registries {
		regs[host] = oci.RegistryConfig{PlainHTTP: r.PlainHTTP, InsecureSkipVerify: r.InsecureSkipVerify, Mirrors: r.Mirrors}
	}
	opts := oci.Options{Logger: klog.FromContext(ctx), Registries: regs}
	if cfg.GuestArch != "" {
		opts.Platform = "linux/" + cfg.GuestArch
	}
	s, err := oci.Open(dir, opts)
	if err != nil {
		return nil, "", fmt.Errorf("image cache: %w", err)
	}
	return s, dir, nil
}

// newVMs builds the VM pod handler and re-adopts the VMs of the state dir.
func newVMs(ctx context.Context, cfg *config.Node, facts nodestatus.Facts, client kubernetes.Interface, images *oci.Store, imageDir string, allocatable func() corev1.ResourceList, tel *telemetry.Telemetry) (*provider.VMs, error) {
	var arch qemu.Arch // "": the host's
	if cfg.GuestArch != "" {
		a, err := qemu.ParseArch(cfg.GuestArch)
		if err != nil {
			return nil, fmt.Errorf("guest architecture: %w", err)
		}
		arch = a
	}
	node := provider.VMSettingsOf(cfg)
	klog.FromContext(ctx).Info("VM CPU placement", "cgroup", node.Placement.Cgroup != nil, "nice", node.Placement.Nice, "why", node.Placement.Why)
	vc := provider.VMsConfig{
		Arch:        arch,
		NodeName:    cfg.NodeName,
		NodeIP:      cfg.NodeIP,
		StateDir:    cfg.StateDir,
		Hypervisor:  provider.QEMU{},
		UEFICode:    cfg.UEFICode,
		UEFIVars:    cfg.UEFIVars,
		Accelerator: facts.Accelerator.Name,
		Images:      images,
		ImageDir:    imageDir,
		Allocatable: allocatable,
		Telemetry:   tel,
		Secrets: func(ctx context.Context, ns, name string) (*corev1.Secret, error) {
			return client.CoreV1().Secrets(ns).Get(ctx, name, metav1.GetOptions{})
		},
		ConfigMaps: func(ctx context.Context, ns, name string) (*corev1.ConfigMap, error) {
			return client.CoreV1().ConfigMaps(ns).Get(ctx, name, metav1.GetOptions{})
		},
		ForceDelete: func(ctx context.Context, pod *corev1.Pod) error {
			return podstatus.FinalDelete(ctx, client.CoreV1(), pod)
		},
		Exporters: exporterRunner(leaseLimits(cfg)),
	}
	node.Apply(&vc)
	vms := provider.NewVMs(ctx, vc)
	res, err := vms.Recover(ctx)
	if err != nil {
		return nil, err
	}
	klog.FromContext(ctx).Info("Recovered VMs from the state dir", "running", res.Running, "exited", res.Exited, "pending", res.Pending, "poweredOff", res.PoweredOff, "orphansRemoved", res.Orphans)
	return vms, nil
}

// leaseLimits are the bounds of every lease on the node (its jumpstarter
// section): one transfer limiter shared by all the node's exporters.
func leaseLimits(cfg *config.Node) jumpstarter.ResourceOptions {
	l := cfg.Leases
	var plain []string
	for host, r := range cfg.Images.Registries {
		if r.PlainHTTP {
			plain = append(plain, host)
		}
	}
	slices.Sort(plain)
	return jumpstarter.ResourceOptions{
		StallTimeout:    l.StallTimeout,
		TransferTimeout: l.TransferTimeout,
		Transfers:       jumpstarter.NewTransferLimiter(l.MaxConcurrentTransfers),
		Fetch: jumpstarter.FetchPolicy{
			AllowNets:           l.AllowNets,
			AllowHosts:          l.AllowHosts,
			Deny:                l.ClusterCIDRs,
			PlainHTTPRegistries: plain,
			AllowPlainHTTP:      l.AllowPlainHTTPRegistries,
		},
	}
}

// exporterRunner runs one pod's Jumpstarter exporter (package
// jumpstarter) until ctx ends, under the node's lease limits; it
// unregisters then.
func exporterRunner(limits jumpstarter.ResourceOptions) exporter.Runner {
	return exporter.RunnerFunc(func(ctx context.Context, cfg jumpstarter.Config) error {
		cfg.Resources = limits
		e, err := jumpstarter.New(cfg)
		if err != nil {
			return err
		}
		return e.Run(ctx)
	})
}

// vmUserSearch lets the VMs' user (vmUser) search, and only search, the
// directories between the main state dir and every node's VM directories
// (stateDir, stateDir/vms, stateDir/arch/<arch>/vms): each gets the
// user's group and mode 0710 (the group's read and write bits, if any,
// go). Created when missing, so that no VM directory is made under a
// directory the user cannot search. Nothing changes when QEMU runs as
// the agent.
func vmUserSearch(cfg *config.Node) error {
	u := provider.VMUserOf(cfg.VMUser)
	if u == nil {
		return nil
	}
	var dirs []string
	for _, n := range append([]*config.Node{cfg}, cfg.GuestArchitectures...) {
		for d := n.StateDir; d != cfg.StateDir && strings.HasPrefix(d, cfg.StateDir+"/"); d = filepath.Dir(d) {
			dirs = append(dirs, d)
		}
		dirs = append(dirs, filepath.Join(n.StateDir, provider.VMsDirName))
	}
	dirs = append(dirs, cfg.StateDir)
	for _, d := range dirs {
		if err := os.MkdirAll(d, 0o710); err != nil {
			return fmt.Errorf("vmUser: %w", err)
		}
		fi, err := os.Stat(d)
		if err != nil {
			return fmt.Errorf("vmUser: %w", err)
		}
		if err := os.Lchown(d, -1, int(u.GID)); err != nil {
			return fmt.Errorf("vmUser: give %s to group %d (needs CAP_CHOWN): %w", d, u.GID, err)
		}
		if err := os.Chmod(d, fi.Mode().Perm()&^0o070|0o010); err != nil {
			return fmt.Errorf("vmUser: chmod %s: %w", d, err)
		}
	}
	for _, d := range dirs {
		if err := qemu.Reachable(*u, d); err != nil {
			return fmt.Errorf("vmUser: QEMU runs as uid %d gid %d and must reach the VM directories: %w (let it search the state dir's parents, or choose another stateDir)", u.UID, u.GID, err)
		}
	}
	return nil
}
