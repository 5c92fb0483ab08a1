// Package teardown is the agent's removal for good: whether the DaemonSet
// that ran it is gone rather than replaced (OwnerGone), and stopping every
// VM under a node's state dir, since no agent will supervise them again
// (StopAllVMs). cmd/qemu-kubelet calls both when it terminates.
//
// teardown knows package qemu's VM records and the apps API; it knows
// nothing of the pod worker (it adopts VMs through Adopter).
package teardown

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	appsv1 "k8s.io/api/apps/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
)

// OwnerGone decides, from what the API server said about the DaemonSet
// that ran this agent (ds, or the error of reading it), whether the agent
// is being removed for good (its VMs must stop with it) rather than
// replaced (an upgrade, a restart: the VMs stay for the next agent).
// Gone: not found, being deleted, or another object of the same name
// (reinstalled); or the agent's credentials were revoked (the chart's
// ServiceAccount is deleted with it). Any other error cannot tell, and
// the VMs are kept.
func OwnerGone(ownerUID types.UID, ds *appsv1.DaemonSet, err error) (gone bool, why string) {
	switch {
	case apierrors.IsNotFound(err):
		return true, "the agent's DaemonSet no longer exists"
	case apierrors.IsUnauthorized(err):
		return true, "the agent's credentials were revoked (its ServiceAccount is gone)"
	case err != nil:
		return false, "cannot read the agent's DaemonSet: " + err.Error()
	case ds == nil:
		return false, "no DaemonSet"
	case ds.UID != ownerUID:
		return true, fmt.Sprintf("the agent's DaemonSet was replaced (uid %s, the agent's was %s)", ds.UID, ownerUID)
	case ds.DeletionTimestamp != nil:
		return true, "the agent's DaemonSet is being deleted"
	}
	return false, "the agent's DaemonSet exists"
}

// VM is what StopAllVMs does with an adopted VM (provider.VM, *qemu.VM).
type VM interface {
	Exit() (qemu.Exit, bool)
	Stop(ctx context.Context, opts qemu.StopOptions) (qemu.Exit, error)
}

// Adopter re-attaches to the VM whose state is in dir
// (provider.QEMU.Adopt: qemu.Adopt).
type Adopter func(ctx context.Context, dir string) (VM, error)

// StopAllVMs stops every VM whose state is under vmsDir (a node's
// <stateDir>/vms; each within grace, then killed), for an agent removed
// for good: nobody would supervise them any more. Their records stay (exit
// recorded): a node started again on this state dir reports how they
// ended. It returns how many VMs were stopped.
func StopAllVMs(ctx context.Context, adopt Adopter, vmsDir string, grace time.Duration) (int, error) {
	dir := vmsDir
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("stop VMs: %w", err)
	}
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		errs    []error
		stopped int
	)
	for _, e := range ents {
		d := filepath.Join(dir, e.Name())
		if _, err := os.Stat(filepath.Join(d, qemu.SpecFileName)); !e.IsDir() || err != nil {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			vm, err := adopt(ctx, d)
			if err != nil {
				mu.Lock()
				errs = append(errs, fmt.Errorf("stop VM %s: %w", d, err))
				mu.Unlock()
				return
			}
			if _, exited := vm.Exit(); exited {
				return
			}
			_, err = vm.Stop(ctx, qemu.StopOptions{Grace: grace, Keep: []string{"*"}})
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, fmt.Errorf("stop VM %s: %w", d, err))
				return
			}
			stopped++
			klog.FromContext(ctx).Info("Stopped VM: the agent is removed for good", "dir", d)
		}()
	}
	wg.Wait()
	return stopped, errors.Join(errs...)
}
