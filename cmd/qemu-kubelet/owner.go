package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider"
	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"github.com/qemu-kubelet/qemu-kubelet/provider/teardown"
	appsv1 "k8s.io/api/apps/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
)

// ownerWatch follows the DaemonSet that runs this agent (--stop-vms-unless-
// owner-exists): at termination, VMs stay for the next agent unless that
// DaemonSet is gone (the chart was uninstalled). A watch started while the
// agent's credentials are valid keeps delivering after they are revoked
// (helm uninstall deletes the ServiceAccount and RBAC right after the
// DaemonSet), so the deletion is seen even when a last read is refused.
type ownerWatch struct {
	client    kubernetes.Interface
	namespace string
	name      string
	uid       types.UID

	mu   sync.Mutex
	gone string // why the owner is gone; "" while it exists
}

// newOwnerWatch finds this pod's DaemonSet from POD_NAMESPACE/POD_NAME
// (downward API).
func newOwnerWatch(ctx context.Context, client kubernetes.Interface) (*ownerWatch, error) {
	ns, name := os.Getenv("POD_NAMESPACE"), os.Getenv("POD_NAME")
	if ns == "" || name == "" {
		return nil, errors.New("--stop-vms-unless-owner-exists needs POD_NAMESPACE and POD_NAME (downward API) to find the agent's DaemonSet")
	}
	pod, err := client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("--stop-vms-unless-owner-exists: read the agent's pod %s/%s: %w", ns, name, err)
	}
	ref := metav1.GetControllerOf(pod)
	if ref == nil || ref.Kind != "DaemonSet" {
		return nil, fmt.Errorf("--stop-vms-unless-owner-exists: pod %s/%s is not run by a DaemonSet", ns, name)
	}
	return &ownerWatch{client: client, namespace: ns, name: ref.Name, uid: ref.UID}, nil
}

func (o *ownerWatch) set(why string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.gone == "" {
		o.gone = why
	}
}

// run watches the DaemonSet until ctx ends.
func (o *ownerWatch) run(ctx context.Context) {
	log := klog.FromContext(ctx).WithValues("daemonSet", klog.KRef(o.namespace, o.name))
	for ctx.Err() == nil {
		w, err := o.client.AppsV1().DaemonSets(o.namespace).Watch(ctx, metav1.ListOptions{FieldSelector: "metadata.name=" + o.name})
		if err == nil {
			for ev := range w.ResultChan() {
				ds, _ := ev.Object.(*appsv1.DaemonSet)
				if ev.Type == watch.Deleted && ds != nil && ds.UID == o.uid {
					o.set("the agent's DaemonSet was deleted")
				} else if ds != nil && (ev.Type == watch.Added || ev.Type == watch.Modified) {
					if gone, why := teardown.OwnerGone(o.uid, ds, nil); gone {
						o.set(why)
					}
				}
			}
			w.Stop()
		} else {
			log.V(2).Info("Watch the agent's DaemonSet", "err", err)
		}
		select {
		case <-ctx.Done():
		case <-time.After(2 * time.Second):
		}
	}
}

// goneNow: what the watch saw, else a last read of the DaemonSet.
func (o *ownerWatch) goneNow(ctx context.Context) (bool, string) {
	o.mu.Lock()
	why := o.gone
	o.mu.Unlock()
	if why != "" {
		return true, why
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	ds, err := o.client.AppsV1().DaemonSets(o.namespace).Get(ctx, o.name, metav1.GetOptions{})
	return teardown.OwnerGone(o.uid, ds, err)
}

// stopVMsIfOwnerGone runs at a clean termination: when the agent's
// DaemonSet is gone, every VM of every node (state dir) is stopped within
// grace, since no agent will come back to supervise them.
func stopVMsIfOwnerGone(o *ownerWatch, nodes []*config.Node, grace time.Duration) {
	ctx := klog.NewContext(context.Background(), klog.Background())
	log := klog.FromContext(ctx)
	gone, why := o.goneNow(ctx)
	if !gone {
		log.Info("Keeping the VMs for the next agent", "why", why)
		return
	}
	log.Info("Stopping every VM: the agent is removed for good", "why", why)
	ctx, cancel := context.WithTimeout(ctx, grace+10*time.Second)
	defer cancel()
	adopt := func(ctx context.Context, dir string) (teardown.VM, error) { return provider.QEMU{}.Adopt(ctx, dir) }
	for _, n := range nodes {
		k, err := teardown.StopAllVMs(ctx, adopt, filepath.Join(n.StateDir, provider.VMsDirName), grace)
		if err != nil {
			log.Error(err, "Stop VMs", "node", n.NodeName)
		}
		log.Info("VMs stopped", "node", n.NodeName, "count", k)
	}
}
