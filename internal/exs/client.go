package exs

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
)

// Errors a caller may test for.
var (
	// ErrNoFreeTarget: the set has no free pod and the client did not
	// ask to wait.
	ErrNoFreeTarget = errors.New("no free target")
	// ErrJumpstarterMode: the set is leased through Jumpstarter.
	ErrJumpstarterMode = errors.New("exporterset in Jumpstarter mode")
	// ErrNotHolder: release of a pod another holder leased, without Force.
	ErrNotHolder = errors.New("leased by another holder")
)

// Client leases, releases and lists through the Kubernetes API. It owns no
// state between calls: every decision is made on what it just read, and
// every write carries the resourceVersion it was decided on.
type Client struct {
	C         client.WithWatch
	Namespace string
	// Progress receives what a waiting lease is waiting for (stderr in
	// the plugin); nil discards it.
	Progress io.Writer
	// Now, when set, replaces time.Now.
	Now func() time.Time
}

func (c *Client) now() time.Time {
	if c.Now != nil {
		return c.Now()
	}
	return time.Now()
}

// LeaseOptions are the options of Lease.
type LeaseOptions struct {
	Holder string        // the lease label's value; see ValidateHolder
	For    time.Duration // > 0: the lease expires after this long
	Wait   bool          // wait for a free pod instead of failing
}

// Lease claims a free pod of set for o.Holder: it lists the set's pods,
// and claims a free one with ClaimPatch (the resourceVersion it read as
// precondition); on Conflict (another client was first) it reads again.
// With o.Wait and no free pod it watches the set's pods from the list's
// resourceVersion until one becomes free, then tries again; ctx bounds
// the wait. It returns the claimed pod and the set.
func (c *Client) Lease(ctx context.Context, set string, o LeaseOptions) (*corev1.Pod, *v1alpha1.ExporterSet, error) {
	if err := ValidateHolder(o.Holder); err != nil {
		return nil, nil, err
	}
	if o.For != 0 {
		if err := ValidateDuration(o.For); err != nil {
			return nil, nil, err
		}
	}
	announced := false
	for {
		s, sel, err := c.standaloneSet(ctx, set)
		if err != nil {
			return nil, nil, err
		}
		var list corev1.PodList
		if err := c.C.List(ctx, &list, client.InNamespace(c.Namespace), client.MatchingLabelsSelector{Selector: sel}); err != nil {
			return nil, nil, c.ctxErr(ctx, set, fmt.Errorf("list pods of exporterset %s/%s: %w", c.Namespace, set, err))
		}
		pods := SetPods(s, list.Items)
		cands := Claimable(pods, c.now())
		// Concurrent clients start from the same list: a random order
		// spreads them over the free pods instead of all on the first.
		rand.Shuffle(len(cands), func(i, j int) { cands[i], cands[j] = cands[j], cands[i] })
		for i := range cands {
			p := &cands[i]
			patch := ClaimPatch(p.ResourceVersion, o.Holder, c.now(), o.For)
			err := c.C.Patch(ctx, p, client.RawPatch(types.MergePatchType, patch))
			switch {
			case err == nil:
				return p, s, nil
			case apierrors.IsConflict(err), apierrors.IsNotFound(err):
				continue // another client was first, or it went
			default:
				return nil, nil, c.ctxErr(ctx, set, fmt.Errorf("claim pod %s/%s: %w", c.Namespace, p.Name, err))
			}
		}
		if len(cands) > 0 {
			continue // every candidate changed under us: read again
		}
		summary := summarize(pods, c.now())
		if !o.Wait {
			return nil, nil, fmt.Errorf("%w in exporterset %s/%s (%s); --wait waits for one", ErrNoFreeTarget, c.Namespace, set, summary)
		}
		if !announced && c.Progress != nil {
			fmt.Fprintf(c.Progress, "Waiting for a free target of exporterset %s/%s (%s)...\n", c.Namespace, set, summary)
			announced = true
		}
		if err := c.waitFree(ctx, s, sel, list.ResourceVersion); err != nil {
			return nil, nil, c.ctxErr(ctx, set, err)
		}
	}
}

// ctxErr turns an error caused by ctx's end into a message about waiting.
func (c *Client) ctxErr(ctx context.Context, set string, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("gave up waiting for a free target of exporterset %s/%s: %w", c.Namespace, set, context.Cause(ctx))
	}
	return err
}

// standaloneSet reads the set and its selector; it refuses a
// Jumpstarter-mode set.
func (c *Client) standaloneSet(ctx context.Context, name string) (*v1alpha1.ExporterSet, labels.Selector, error) {
	var s v1alpha1.ExporterSet
	if err := c.C.Get(ctx, client.ObjectKey{Namespace: c.Namespace, Name: name}, &s); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, nil, fmt.Errorf("exporterset %s/%s not found", c.Namespace, name)
		}
		return nil, nil, fmt.Errorf("get exporterset %s/%s: %w", c.Namespace, name, err)
	}
	if err := standalone(&s); err != nil {
		return nil, nil, err
	}
	sel, err := metav1.LabelSelectorAsSelector(s.Spec.Selector)
	if err != nil {
		return nil, nil, fmt.Errorf("exporterset %s/%s: selector: %w", c.Namespace, name, err)
	}
	return &s, sel, nil
}

// standalone refuses a Jumpstarter-mode set, saying what to use instead.
func standalone(s *v1alpha1.ExporterSet) error {
	js := s.Spec.Jumpstarter
	if js == nil {
		return nil
	}
	var sel []string
	for k, v := range js.ExporterLabels {
		sel = append(sel, k+"="+v)
	}
	slices.Sort(sel)
	return fmt.Errorf("%w: exporterset %s/%s is leased through Jumpstarter (spec.jumpstarter), not by pod labels; use jmp, e.g. `jmp create lease -l %s`",
		ErrJumpstarterMode, s.Namespace, s.Name, strings.Join(sel, ","))
}

// summarize counts pods by state: "3 pods: 2 leased, 1 booting".
func summarize(pods []corev1.Pod, now time.Time) string {
	if len(pods) == 0 {
		return "no pods"
	}
	n := map[State]int{}
	for i := range pods {
		n[Classify(&pods[i], now)]++
	}
	var parts []string
	for _, s := range []State{Free, Leased, Expired, Booting, Recycling, Failed} {
		if n[s] > 0 {
			parts = append(parts, fmt.Sprintf("%d %s", n[s], s))
		}
	}
	return fmt.Sprintf("%d pods: %s", len(pods), strings.Join(parts, ", "))
}

// waitFree watches the set's pods from resourceVersion rv and returns when
// one of them is free, or when the watch ends (the caller lists again).
func (c *Client) waitFree(ctx context.Context, s *v1alpha1.ExporterSet, sel labels.Selector, rv string) error {
	w, err := c.C.Watch(ctx, &corev1.PodList{}, client.InNamespace(c.Namespace), client.MatchingLabelsSelector{Selector: sel},
		&client.ListOptions{Raw: &metav1.ListOptions{ResourceVersion: rv}})
	if err != nil {
		return fmt.Errorf("watch pods of exporterset %s/%s: %w", c.Namespace, s.Name, err)
	}
	defer w.Stop()
	for {
		select {
		case <-ctx.Done():
			return context.Cause(ctx)
		case ev, ok := <-w.ResultChan():
			if !ok || ev.Type == watch.Error {
				return nil // expired or closed: list again
			}
			p, isPod := ev.Object.(*corev1.Pod)
			if !isPod || ev.Type == watch.Deleted {
				continue
			}
			if ref := metav1.GetControllerOf(p); ref != nil && ref.UID == s.UID && Classify(p, c.now()) == Free {
				return nil
			}
		}
	}
}

// ReleaseOptions are the options of Release.
type ReleaseOptions struct {
	// Holder, when set, must be the pod's holder unless Force.
	Holder string
	Force  bool
}

// Release ends the lease of pod with ReleasePatch (resourceVersion
// precondition; read again on Conflict). The set's controller then
// recycles the pod (Replace: deletes it; Reuse: back to the buffer). It
// returns the pod as released, its former holder and its set (nil if the
// set is gone).
func (c *Client) Release(ctx context.Context, pod string, o ReleaseOptions) (*corev1.Pod, string, *v1alpha1.ExporterSet, error) {
	pod = strings.TrimPrefix(pod, "pod/")
	pod = strings.TrimPrefix(pod, "pods/")
	for attempt := 0; ; attempt++ {
		var p corev1.Pod
		if err := c.C.Get(ctx, client.ObjectKey{Namespace: c.Namespace, Name: pod}, &p); err != nil {
			if apierrors.IsNotFound(err) {
				return nil, "", nil, fmt.Errorf("pod %s/%s not found", c.Namespace, pod)
			}
			return nil, "", nil, fmt.Errorf("get pod %s/%s: %w", c.Namespace, pod, err)
		}
		ref := metav1.GetControllerOf(&p)
		if ref == nil || ref.Kind != "ExporterSet" || ref.APIVersion != v1alpha1.GroupVersion.String() {
			return nil, "", nil, fmt.Errorf("pod %s/%s is not a pod of an ExporterSet", c.Namespace, pod)
		}
		var set *v1alpha1.ExporterSet
		var s v1alpha1.ExporterSet
		switch err := c.C.Get(ctx, client.ObjectKey{Namespace: c.Namespace, Name: ref.Name}, &s); {
		case err == nil && s.UID == ref.UID:
			set = &s
			if err := standalone(set); err != nil {
				return nil, "", nil, err
			}
		case err != nil && !apierrors.IsNotFound(err):
			return nil, "", nil, fmt.Errorf("get exporterset %s/%s: %w", c.Namespace, ref.Name, err)
		}
		holder, leased := p.Labels[v1alpha1.LeaseLabel]
		if !leased {
			return nil, "", set, fmt.Errorf("pod %s/%s is not leased (state %s)", c.Namespace, pod, Classify(&p, c.now()))
		}
		if !o.Force && o.Holder != "" && holder != o.Holder {
			return nil, holder, set, fmt.Errorf("%w: pod %s/%s is leased by %q, not by %q; --holder %s or --force releases it",
				ErrNotHolder, c.Namespace, pod, holder, o.Holder, holder)
		}
		err := c.C.Patch(ctx, &p, client.RawPatch(types.MergePatchType, ReleasePatch(p.ResourceVersion)))
		switch {
		case err == nil:
			return &p, holder, set, nil
		case apierrors.IsConflict(err) && attempt < 5:
			continue // changed since read (e.g. the controller's used mark): read again
		case apierrors.IsNotFound(err):
			return nil, holder, set, fmt.Errorf("pod %s/%s is gone", c.Namespace, pod)
		default:
			return nil, holder, set, fmt.Errorf("release pod %s/%s: %w", c.Namespace, pod, err)
		}
	}
}

// List reads the sets of the namespace (only name, when not empty) and the
// pods each controls.
func (c *Client) List(ctx context.Context, name string) ([]SetView, error) {
	var sets []v1alpha1.ExporterSet
	if name != "" {
		var s v1alpha1.ExporterSet
		if err := c.C.Get(ctx, client.ObjectKey{Namespace: c.Namespace, Name: name}, &s); err != nil {
			if apierrors.IsNotFound(err) {
				return nil, fmt.Errorf("exporterset %s/%s not found", c.Namespace, name)
			}
			return nil, fmt.Errorf("get exporterset %s/%s: %w", c.Namespace, name, err)
		}
		sets = append(sets, s)
	} else {
		var l v1alpha1.ExporterSetList
		if err := c.C.List(ctx, &l, client.InNamespace(c.Namespace)); err != nil {
			return nil, fmt.Errorf("list exportersets in %s: %w", c.Namespace, err)
		}
		sets = l.Items
	}
	var out []SetView
	for _, s := range sets {
		sv := SetView{Set: s}
		if sel, err := metav1.LabelSelectorAsSelector(s.Spec.Selector); err == nil && !sel.Empty() {
			var pods corev1.PodList
			if err := c.C.List(ctx, &pods, client.InNamespace(c.Namespace), client.MatchingLabelsSelector{Selector: sel}); err != nil {
				return nil, fmt.Errorf("list pods of exporterset %s/%s: %w", c.Namespace, s.Name, err)
			}
			sv.Pods = SetPods(&s, pods.Items)
		}
		out = append(out, sv)
	}
	slices.SortFunc(out, func(a, b SetView) int { return strings.Compare(a.Set.Name, b.Set.Name) })
	return out, nil
}
