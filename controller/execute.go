package controller

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"strconv"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/rand"
	"sigs.k8s.io/controller-runtime/pkg/client"
	logf "sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
)

// The executor: it applies a plan's set patch and pod actions through the
// Kubernetes API and records events.

// Event reasons.
const (
	EventSuccessfulCreate = "SuccessfulCreate"
	EventFailedCreate     = "FailedCreate"
	EventSuccessfulDelete = "SuccessfulDelete"
	EventFailedDelete     = "FailedDelete"
	// EventLeaseExpired: a lease reached its expiry (Reuse policy: the
	// lease label was removed; Replace: SuccessfulDelete says LeaseExpired).
	EventLeaseExpired = "LeaseExpired"
	// EventInvalidLeaseExpiry: a pod's lease expiry annotation cannot be
	// read; the lease does not expire.
	EventInvalidLeaseExpiry = "InvalidLeaseExpiry"
	// EventReplicasLowered: spec.replicas lowered for pods marked with
	// v1alpha1.RemoveAnnotation.
	EventReplicasLowered = "ReplicasLowered"
)

// patchSet writes a plan's SetPatch: spec.replicas lowered for counted
// removals and the removal bookkeeping, in one merge patch with the set's
// resourceVersion as precondition. set is updated from the answer.
func (r *Reconciler) patchSet(ctx context.Context, set *v1alpha1.ExporterSet, p *SetPatch) error {
	var removing any // null removes the annotation
	if len(p.Removing) > 0 {
		ids := make([]string, len(p.Removing))
		for i, u := range p.Removing {
			ids[i] = string(u)
		}
		removing = strings.Join(ids, ",")
	}
	body := map[string]any{"metadata": map[string]any{"resourceVersion": set.ResourceVersion,
		"annotations": map[string]any{v1alpha1.RemovingAnnotation: removing}}}
	before := derefOr(set.Spec.Replicas, 1)
	if p.Replicas != nil {
		body["spec"] = map[string]any{"replicas": *p.Replicas}
	}
	b, err := json.Marshal(body)
	if err != nil {
		return fmt.Errorf("encode exporterset patch: %w", err)
	}
	if err := r.Client.Patch(ctx, set, client.RawPatch(types.MergePatchType, b)); err != nil {
		return fmt.Errorf("patch exporterset %s/%s (removals): %w", set.Namespace, set.Name, err)
	}
	if p.Replicas != nil {
		r.Recorder.Eventf(set, nil, corev1.EventTypeNormal, EventReplicasLowered, "ScaleIn", "spec.replicas %d -> %d for pods marked %s=true: %s",
			before, *p.Replicas, v1alpha1.RemoveAnnotation, strings.Join(p.Counted, ", "))
	}
	return nil
}

// execute applies the plan's pod actions. It returns an error when pods
// could not be created (the request is then retried with rate-limited
// backoff); failed deletes and precondition conflicts are retried on the
// next event or requeue.
func (r *Reconciler) execute(ctx context.Context, set *v1alpha1.ExporterSet, key types.NamespacedName, hash string, js *jsState, acts Actions, now time.Time) error {
	log := logf.FromContext(ctx)
	if js != nil {
		acts.Delete = r.js().executeJumpstarter(ctx, ourJS(set), js, acts, now)
	}
	for _, p := range acts.ExpireLease {
		patch := fmt.Appendf(nil, `{"metadata":{"resourceVersion":%q,"labels":{%q:null},"annotations":{%q:null,%q:null}}}`,
			p.ResourceVersion, v1alpha1.LeaseLabel, v1alpha1.LeaseExpiresAnnotation, v1alpha1.LeasedAtAnnotation)
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: set.Namespace}}
		switch err := r.Client.Patch(ctx, pod, client.RawPatch(types.MergePatchType, patch)); {
		case err == nil:
			r.Recorder.Eventf(set, nil, corev1.EventTypeNormal, EventLeaseExpired, "Expire", "Lease of pod %s expired; back to the buffer", p.Name)
		case !apierrors.IsNotFound(err):
			// A conflict: the holder changed the pod (e.g. extended the
			// lease); its event brings a fresh plan.
			log.Info("end expired lease", "pod", p.Name, "err", err.Error())
		}
	}
	for _, p := range acts.ClearUsed {
		patch := fmt.Appendf(nil, `{"metadata":{"resourceVersion":%q,"labels":{%q:null},"annotations":{%q:null,%q:null}}}`,
			p.ResourceVersion, v1alpha1.UsedLabel, v1alpha1.LeaseExpiresAnnotation, v1alpha1.LeasedAtAnnotation)
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: set.Namespace}}
		if err := r.Client.Patch(ctx, pod, client.RawPatch(types.MergePatchType, patch)); err != nil && !apierrors.IsNotFound(err) {
			log.Info("clear used mark", "pod", p.Name, "err", err.Error())
		}
	}
	for _, p := range acts.MarkUsed {
		patch := fmt.Appendf(nil, `{"metadata":{"resourceVersion":%q,"labels":{%q:"true"}}}`, p.ResourceVersion, v1alpha1.UsedLabel)
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: set.Namespace}}
		if err := r.Client.Patch(ctx, pod, client.RawPatch(types.MergePatchType, patch)); err != nil && !apierrors.IsNotFound(err) {
			log.Info("add used mark", "pod", p.Name, "err", err.Error())
		}
	}
	for _, d := range acts.Delete {
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: d.Name, Namespace: set.Namespace}}
		uid, rv := d.UID, d.ResourceVersion
		err := r.Client.Delete(ctx, pod, client.Preconditions{UID: &uid, ResourceVersion: &rv})
		switch {
		case err == nil:
			r.expectations().ExpectDelete(key, d.UID, now)
			r.Recorder.Eventf(set, nil, corev1.EventTypeNormal, EventSuccessfulDelete, "Delete", "Deleted pod: %s (%s)", d.Name, d.Reason)
			if js != nil && js.exporters[d.Name] != nil {
				r.js().deleteExporter(ctx, set.Namespace, d.Name)
			}
		case apierrors.IsNotFound(err):
		case apierrors.IsConflict(err):
			// Changed since the decision (e.g. just claimed): keep it; the
			// change's event brings a fresh plan.
			log.V(1).Info("pod changed since the plan; not deleted", "pod", d.Name, "reason", d.Reason)
		default:
			r.Recorder.Eventf(set, nil, corev1.EventTypeWarning, EventFailedDelete, "Delete", "Error deleting pod %s: %v", d.Name, err)
		}
	}
	if acts.Create > 0 {
		if js != nil && len(js.demand) > 0 {
			r.Recorder.Eventf(set, nil, corev1.EventTypeNormal, EventLeaseDemand, "ScaleUp", "Creating %d pods for %d pending leases: %s",
				acts.Create, len(js.demand), leaseList(js.demand))
		}
		if err := r.createPods(ctx, set, key, hash, int(acts.Create), now); err != nil {
			return err
		}
	}
	return nil
}

// createPods creates n pods in slow-start batches (1, 2, 4, ...) as the
// ReplicaSet controller does: all of them in one pass when the API accepts
// them, few wasted calls when it refuses (quota, admission).
func (r *Reconciler) createPods(ctx context.Context, set *v1alpha1.ExporterSet, key types.NamespacedName, hash string, n int, now time.Time) error {
	for batch, done := 1, 0; done < n; batch *= 2 {
		size := min(batch, n-done)
		errs := make([]error, size)
		names := make([]string, size)
		var wg sync.WaitGroup
		for i := range size {
			wg.Go(func() {
				if set.Spec.Jumpstarter != nil {
					names[i], errs[i] = r.createJumpstarterPod(ctx, set, key, hash, now)
					return
				}
				pod := newPod(set, hash)
				if err := r.Client.Create(ctx, pod); err != nil {
					errs[i] = err
					return
				}
				r.expectations().ExpectCreate(key, pod.Name, now)
				names[i] = pod.Name
			})
		}
		wg.Wait()
		// One event per batch, not per pod: a 100-pod scale-up writes 7
		// events instead of 100 (the apiserver is busy creating the pods).
		if created := compact(names); len(created) > 0 {
			// The events of one pass fold into one (same reason, same
			// version of the set): the log names every pod.
			logf.FromContext(ctx).V(1).Info("created pods", "pods", created)
			r.Recorder.Eventf(set, nil, corev1.EventTypeNormal, EventSuccessfulCreate, "Create", "Created %s", podList(created))
		}
		if err := errors.Join(errs...); err != nil {
			r.Recorder.Eventf(set, nil, corev1.EventTypeWarning, EventFailedCreate, "Create", "Error creating pod: %v", firstErr(errs))
			return fmt.Errorf("create pods for exporterset %s (%d of %d done): %w", key, done+len(compact(names)), n, err)
		}
		done += size
	}
	return nil
}

// createJumpstarterPod creates one gated pod and its Exporter. A failed
// Exporter create is retried by the next reconcile (setupPods).
func (r *Reconciler) createJumpstarterPod(ctx context.Context, set *v1alpha1.ExporterSet, key types.NamespacedName, hash string, now time.Time) (string, error) {
	var pod *corev1.Pod
	var err error
	for range 3 { // a name taken by chance: draw another
		pod = newJumpstarterPod(set, hash)
		if err = r.Client.Create(ctx, pod); !apierrors.IsAlreadyExists(err) {
			break
		}
	}
	if err != nil {
		return "", err
	}
	r.expectations().ExpectCreate(key, pod.Name, now)
	if err := r.Client.Create(ctx, newExporter(ourJS(set), pod)); err != nil && !apierrors.IsAlreadyExists(err) {
		logf.FromContext(ctx).Info("create exporter; retried on the next pass", "exporter", pod.Name, "err", err.Error())
	}
	return pod.Name, nil
}

func compact(names []string) []string {
	var out []string
	for _, n := range names {
		if n != "" {
			out = append(out, n)
		}
	}
	return out
}

func firstErr(errs []error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// podList renders "pod: a" or "3 pods: a, b, c", with at most 10 names.
func podList(names []string) string {
	if len(names) == 1 {
		return "pod: " + names[0]
	}
	shown := names[:min(len(names), 10)]
	s := fmt.Sprintf("%d pods: %s", len(names), strings.Join(shown, ", "))
	if len(names) > len(shown) {
		s += fmt.Sprintf(" and %d more", len(names)-len(shown))
	}
	return s
}

// TemplateHash is a short, stable hash of a pod template; pods carry it in
// v1alpha1.TemplateHashLabel.
func TemplateHash(t *corev1.PodTemplateSpec) string {
	h := fnv.New32a()
	b, _ := json.Marshal(t) // a PodTemplateSpec always marshals
	h.Write(b)
	return rand.SafeEncodeString(strconv.FormatUint(uint64(h.Sum32()), 10))
}

// newPod builds a pod of the set from its template.
func newPod(set *v1alpha1.ExporterSet, hash string) *corev1.Pod {
	t := set.Spec.Template.DeepCopy()
	lbls := make(map[string]string, len(t.Labels)+1)
	for k, v := range t.Labels {
		lbls[k] = v
	}
	delete(lbls, v1alpha1.LeaseLabel) // a new pod is never born leased
	delete(lbls, v1alpha1.UsedLabel)
	lbls[v1alpha1.TemplateHashLabel] = hash
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			GenerateName:    set.Name + "-",
			Namespace:       set.Namespace,
			Labels:          lbls,
			Annotations:     t.Annotations,
			Finalizers:      t.Finalizers,
			OwnerReferences: []metav1.OwnerReference{*metav1.NewControllerRef(set, v1alpha1.GroupVersion.WithKind("ExporterSet"))},
		},
		Spec: t.Spec,
	}
}
