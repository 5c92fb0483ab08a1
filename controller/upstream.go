package controller

import (
	"context"
	"errors"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	crcontroller "sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	logf "sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	jsv1 "github.com/qemu-kubelet/qemu-kubelet/api/jumpstarter/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	vtv1 "github.com/qemu-kubelet/qemu-kubelet/api/virtualtarget/v1alpha1"
)

// upstreamClassIndex indexes upstream ExporterSets by their class.
const upstreamClassIndex = "spec.virtualTargetClassName"

// UpstreamReconciler serves upstream Jumpstarter's ExporterSets
// (virtualtarget.jumpstarter.dev/v1alpha1) whose VirtualTargetClass names
// Provisioner: it plans them with Plan and runs their instances as VM pods.
// A set of any other provisioner (or whose class does not exist: no
// provisioner can be told) is left alone: no status write, no event, no
// pod.
//
// Its state, owned by the reconciler and safe for its workers: the
// expectations (pods created or deleted and not yet seen by the cache) and
// the planner's memory of each set (upstreamMemory: what our own sets keep
// in their status, such as when a scale-down's cooldown started and the
// failure backoff).
type UpstreamReconciler struct {
	Client client.Client
	// APIReader reads uncached (credentials, the CA bundle, the check
	// before a delete); the manager's when nil at setup.
	APIReader client.Reader
	Recorder  events.EventRecorder
	// Provisioner is the name this controller serves
	// (vtv1.DefaultProvisioner when empty).
	Provisioner string
	// DrainDelay as Reconciler.DrainDelay.
	DrainDelay time.Duration
	// Now, when set, replaces time.Now.
	Now func() time.Time
	// Jumpstarter says the API server serves Jumpstarter's Exporters and
	// Leases (SetupWithManager finds out): without them a set is Degraded.
	Jumpstarter bool

	exp *expectations
	mem *upstreamMemory
}

// NewUpstreamReconciler returns an UpstreamReconciler for provisioner.
func NewUpstreamReconciler(c client.Client, rec events.EventRecorder, provisioner string) *UpstreamReconciler {
	return &UpstreamReconciler{Client: c, Recorder: rec, Provisioner: provisioner, exp: newExpectations(), mem: newUpstreamMemory()}
}

func (r *UpstreamReconciler) provisioner() string {
	if r.Provisioner == "" {
		return vtv1.DefaultProvisioner
	}
	return r.Provisioner
}

func (r *UpstreamReconciler) now() time.Time {
	if r.Now != nil {
		return r.Now()
	}
	return time.Now()
}

// UpstreamServed reports whether the manager's scheme has upstream's
// ExporterSet and VirtualTargetClass and the API server serves them
// (Served: an error when discovery does not answer).
func UpstreamServed(mgr ctrl.Manager) (bool, error) {
	return Served(mgr, vtv1.GroupVersion, "ExporterSet", "VirtualTargetClass")
}

// SetupWithManager registers the controller: upstream sets (spec
// changes), their pods, and classes (a class change plans the sets naming
// it again).
func (r *UpstreamReconciler) SetupWithManager(mgr ctrl.Manager, workers int) error {
	if r.exp == nil {
		r.exp = newExpectations()
	}
	if r.mem == nil {
		r.mem = newUpstreamMemory()
	}
	if r.APIReader == nil {
		r.APIReader = mgr.GetAPIReader()
	}
	if err := mgr.GetFieldIndexer().IndexField(context.Background(), &vtv1.ExporterSet{}, upstreamClassIndex, func(o client.Object) []string {
		return []string{o.(*vtv1.ExporterSet).Spec.VirtualTargetClassName}
	}); err != nil {
		return fmt.Errorf("index virtualtarget exportersets by %s: %w", upstreamClassIndex, err)
	}
	owner := handler.EnqueueRequestForOwner(mgr.GetScheme(), mgr.GetRESTMapper(), &vtv1.ExporterSet{}, handler.OnlyControllerOwner())
	b := ctrl.NewControllerManagedBy(mgr).
		Named("virtualtarget-exporterset").
		For(&vtv1.ExporterSet{}, builder.WithPredicates(predicate.GenerationChangedPredicate{})).
		Watches(&corev1.Pod{}, podEvents{exp: r.exp, inner: owner, owner: vtv1.GroupVersion.String()}).
		Watches(&vtv1.VirtualTargetClass{}, handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
			var sets vtv1.ExporterSetList
			if err := mgr.GetClient().List(ctx, &sets, client.InNamespace(o.GetNamespace()), client.MatchingFields{upstreamClassIndex: o.GetName()}); err != nil {
				logf.FromContext(ctx).Error(err, "list virtualtarget exportersets of class", "class", o.GetName())
				return nil
			}
			out := make([]reconcile.Request, 0, len(sets.Items))
			for _, s := range sets.Items {
				out = append(out, reconcile.Request{NamespacedName: types.NamespacedName{Namespace: s.Namespace, Name: s.Name}})
			}
			return out
		})).
		WithOptions(crcontroller.Options{MaxConcurrentReconciles: max(workers, 1)})
	js, err := jumpstarterServed(mgr)
	if err != nil {
		return err
	}
	if r.Jumpstarter = js; r.Jumpstarter {
		// An Exporter names its set in a label (a pod's Exporter is owned
		// by the pod); a Lease may concern any set of its namespace.
		b = b.Watches(&jsv1.Exporter{}, handler.EnqueueRequestsFromMapFunc(func(_ context.Context, o client.Object) []reconcile.Request {
			if n := o.GetLabels()[UpstreamExporterSetLabel]; n != "" {
				return []reconcile.Request{{NamespacedName: types.NamespacedName{Namespace: o.GetNamespace(), Name: n}}}
			}
			return nil
		})).Watches(&jsv1.Lease{}, handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
			var sets vtv1.ExporterSetList
			if err := mgr.GetClient().List(ctx, &sets, client.InNamespace(o.GetNamespace())); err != nil {
				return nil
			}
			out := make([]reconcile.Request, 0, len(sets.Items))
			for _, s := range sets.Items {
				out = append(out, reconcile.Request{NamespacedName: types.NamespacedName{Namespace: s.Namespace, Name: s.Name}})
			}
			return out
		}))
	}
	return b.Complete(r)
}

// Reconcile plans one upstream set of this provisioner and applies the plan.
func (r *UpstreamReconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	res, err := r.reconcile(ctx, req)
	if err != nil && ctx.Err() != nil && errors.Is(err, context.Canceled) {
		return res, nil
	}
	return res, err
}

func (r *UpstreamReconciler) reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	key := req.NamespacedName
	var set vtv1.ExporterSet
	if err := r.Client.Get(ctx, key, &set); err != nil {
		if apierrors.IsNotFound(err) {
			r.exp.Forget(key)
			r.mem.Forget(key)
			return ctrl.Result{}, nil
		}
		return ctrl.Result{}, fmt.Errorf("get virtualtarget exporterset %s: %w", key, err)
	}
	var class vtv1.VirtualTargetClass
	if err := r.Client.Get(ctx, types.NamespacedName{Namespace: set.Namespace, Name: set.Spec.VirtualTargetClassName}, &class); err != nil {
		if apierrors.IsNotFound(err) {
			return ctrl.Result{}, nil // whose set it is cannot be told: the class's creation plans it again
		}
		return ctrl.Result{}, fmt.Errorf("get virtualtargetclass %s/%s of exporterset %s: %w", set.Namespace, set.Spec.VirtualTargetClassName, key, err)
	}
	if class.Spec.Provisioner != r.provisioner() {
		r.mem.Forget(key)
		return ctrl.Result{}, nil // another provisioner's set: never touched
	}
	if set.DeletionTimestamp != nil {
		r.mem.Forget(key)
		return ctrl.Result{}, nil // the garbage collector deletes the pods
	}
	now := r.now()
	spec, cerr := MapUpstream(&set, &class, r.drainDelay())
	if cerr == nil && !r.Jumpstarter {
		cerr = &ClassError{"JumpstarterUnavailable", "the API server does not serve jumpstarter.dev/v1alpha1 Exporters and Leases: install Jumpstarter's CRDs and restart the controller"}
	}
	if cerr != nil {
		st, conds := upstreamStatus(set.Status, upstreamStatusInput{Failure: cerr})
		return ctrl.Result{}, r.writeStatus(ctx, &set, st, conds, now)
	}
	sel := labels.SelectorFromSet(labels.Set{UpstreamLabel: set.Name})
	var list corev1.PodList
	if err := r.Client.List(ctx, &list, client.InNamespace(set.Namespace), client.MatchingLabelsSelector{Selector: sel}); err != nil {
		return ctrl.Result{}, fmt.Errorf("list pods of virtualtarget exporterset %s: %w", key, err)
	}
	owned := list.Items[:0]
	for i := range list.Items {
		if metav1.IsControlledBy(&list.Items[i], &set) {
			owned = append(owned, list.Items[i])
		}
	}
	ca, err := r.caBundle(ctx, set.Namespace)
	if err != nil {
		return ctrl.Result{}, err
	}
	target := upstreamTarget(&set, spec.Knobs.Recycle == v1alpha1.RecyclePolicyReuse, ca)
	js, err := readJumpstarter(ctx, r.Client, target, owned, now)
	if err != nil {
		return ctrl.Result{}, err
	}
	creating, deleting := r.exp.Pending(key, owned, now)
	gated := r.js().setupPods(ctx, target, owned, deleting, js)
	in := spec.Knobs
	in.TemplateHash = upstreamHash(&spec.Template, set.Spec.Template.Metadata.Labels)
	in.PendingCreates, in.Demand, in.Now = int32(len(creating)), int32(len(js.demand)), now
	in.Jumpstarter.Cold = exporterState(js.cold)
	in.Jumpstarter.Cold.Leased = js.coldLease != ""
	js.sweepInput(in.Jumpstarter, set.Name, creating, deleting)
	r.mem.Get(key, set.UID).into(&in) // what our sets read from their status
	for i := range owned {
		if !deleting[owned[i].UID] {
			ps := podState(&owned[i], js.leases[owned[i].Name])
			ps.Exporter = exporterState(js.exporters[ps.Name])
			ps.GateReason = gated[ps.Name]
			in.Pods = append(in.Pods, ps)
		}
	}
	acts := Plan(in)
	acts.Delete = r.executeJumpstarter(ctx, target, js, acts, now)
	execErr := r.execute(ctx, &set, target, js, &spec.Template, in.TemplateHash, acts, now)
	if execErr != nil {
		acts.Status.Conditions = append(acts.Status.Conditions,
			Condition{v1alpha1.ConditionReplicaFailure, metav1.ConditionTrue, EventFailedCreate, execErr.Error()})
	}
	// What our sets' status write keeps; kept whether or not the write
	// below succeeds, as the plan's creates and deletes were made.
	r.mem.Put(key, set.UID, memoryOf(acts.Status))
	st, conds := upstreamStatus(set.Status, upstreamStatusInput{Plan: &acts.Status, Pods: owned, Exporters: js.exporters, Knobs: spec.Knobs,
		Selector: upstreamSelector(&set)})
	if err := r.writeStatus(ctx, &set, st, conds, now); err != nil {
		if apierrors.IsConflict(err) && execErr == nil {
			return ctrl.Result{RequeueAfter: 200 * time.Millisecond}, nil
		}
		return ctrl.Result{}, errors.Join(execErr, err)
	}
	return ctrl.Result{RequeueAfter: acts.RequeueAfter}, execErr
}

func (r *UpstreamReconciler) drainDelay() time.Duration {
	if r.DrainDelay == 0 {
		return DefaultDrainDelay
	}
	return r.DrainDelay
}

// execute deletes the plan's pods that may go (with their Exporters) and
// creates its new ones (gated, each with its Exporter).
func (r *UpstreamReconciler) execute(ctx context.Context, set *vtv1.ExporterSet, target jsTarget, js *jsState, t *corev1.PodTemplateSpec, hash string, acts Actions, now time.Time) error {
	key := client.ObjectKeyFromObject(set)
	for _, d := range acts.Delete {
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: d.Name, Namespace: set.Namespace}}
		uid, rv := d.UID, d.ResourceVersion
		switch err := r.Client.Delete(ctx, pod, client.Preconditions{UID: &uid, ResourceVersion: &rv}); {
		case err == nil:
			r.exp.ExpectDelete(key, d.UID, now)
			r.Recorder.Eventf(set, nil, corev1.EventTypeNormal, EventSuccessfulDelete, "Delete", "Deleted pod: %s (%s)", d.Name, d.Reason)
			if js.exporters[d.Name] != nil {
				r.js().deleteExporter(ctx, set.Namespace, d.Name)
			}
		case apierrors.IsNotFound(err), apierrors.IsConflict(err):
		default:
			r.Recorder.Eventf(set, nil, corev1.EventTypeWarning, EventFailedDelete, "Delete", "Error deleting pod %s: %v", d.Name, err)
		}
	}
	if acts.Create > 0 && len(js.demand) > 0 {
		r.Recorder.Eventf(set, nil, corev1.EventTypeNormal, EventLeaseDemand, "ScaleUp", "Creating %d pods for %d pending leases: %s",
			acts.Create, len(js.demand), leaseList(js.demand))
	}
	var created []string
	var errs []error
	for range acts.Create {
		pod, err := r.createPod(ctx, set, target, t, hash)
		if err != nil {
			errs = append(errs, err)
			break // the next pass retries, with the planner's backoff
		}
		r.exp.ExpectCreate(key, pod.Name, now)
		created = append(created, pod.Name)
	}
	if len(created) > 0 {
		r.Recorder.Eventf(set, nil, corev1.EventTypeNormal, EventSuccessfulCreate, "Create", "Created %s", podList(created))
	}
	if err := errors.Join(errs...); err != nil {
		r.Recorder.Eventf(set, nil, corev1.EventTypeWarning, EventFailedCreate, "Create", "Error creating pod: %v", err)
		return fmt.Errorf("create pods for virtualtarget exporterset %s (%d of %d done): %w", key, len(created), acts.Create, err)
	}
	return nil
}

// newUpstreamPod builds a VM pod of an upstream set, controlled by it.
// It carries the set's template labels (those of its Exporters), so that
// spec.selector, serialized in status.selector for the scale subresource,
// selects the pods as upstream's do; this controller's own labels win.
func newUpstreamPod(set *vtv1.ExporterSet, t *corev1.PodTemplateSpec, hash string) *corev1.Pod {
	lbls := make(map[string]string, len(set.Spec.Template.Metadata.Labels)+len(t.Labels)+2)
	for k, v := range set.Spec.Template.Metadata.Labels {
		lbls[k] = v
	}
	delete(lbls, v1alpha1.LeaseLabel) // a new pod is never born leased (nor used)
	delete(lbls, v1alpha1.UsedLabel)
	for k, v := range t.Labels {
		lbls[k] = v
	}
	lbls[v1alpha1.TemplateHashLabel] = hash
	lbls[UpstreamExporterSetLabel] = set.Name
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			GenerateName:    set.Name + "-",
			Namespace:       set.Namespace,
			Labels:          lbls,
			Annotations:     t.Annotations,
			OwnerReferences: []metav1.OwnerReference{*metav1.NewControllerRef(set, vtv1.GroupVersion.WithKind("ExporterSet"))},
		},
		Spec: *t.Spec.DeepCopy(),
	}
}

// writeStatus writes st with conds when it differs from the set's status.
func (r *UpstreamReconciler) writeStatus(ctx context.Context, set *vtv1.ExporterSet, st vtv1.ExporterSetStatus, conds upstreamConditions, now time.Time) error {
	st.Conditions = append([]metav1.Condition(nil), set.Status.Conditions...)
	for _, c := range conds {
		meta.SetStatusCondition(&st.Conditions, metav1.Condition{Type: c.Type, Status: c.Status, Reason: c.Reason,
			Message: c.Message, ObservedGeneration: set.Generation, LastTransitionTime: metav1.NewTime(now.Truncate(time.Second))})
	}
	if equality.Semantic.DeepEqual(set.Status, st) {
		return nil
	}
	set.Status = st
	if err := r.Client.Status().Update(ctx, set); err != nil {
		return fmt.Errorf("update status of virtualtarget exporterset %s/%s: %w", set.Namespace, set.Name, err)
	}
	return nil
}
