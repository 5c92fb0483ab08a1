package controller

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	crcontroller "sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	logf "sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"k8s.io/client-go/util/workqueue"

	jsv1 "github.com/qemu-kubelet/qemu-kubelet/api/jumpstarter/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
)

// classNameIndex indexes ExporterSets by spec.className in the cache.
const classNameIndex = "spec.className"

// Reconciler applies Plan to ExporterSets through the Kubernetes API.
type Reconciler struct {
	// Client writes (pods, status) and, unless Reader is set, reads.
	Client client.Client
	// Reader, when set, is where sets and pods are read from (tests use it to
	// simulate a lagging cache).
	Reader client.Reader
	// APIReader, when set, reads the set uncached before a plan's pods are
	// created or deleted while the cache may not have seen this
	// controller's last status write (SetupWithManager sets the manager's).
	// The status carries the failure backoff and the scale-down cooldown: a
	// cached set missing the last write (the cache lags by milliseconds)
	// would plan with an expired backoff and create at once. Such a set is
	// planned again once the cache caught up.
	APIReader client.Reader
	Recorder  events.EventRecorder
	// Leases is the lease source; nil means LabelLeases.
	Leases LeaseSource
	// Metrics, when set, receives per-set gauges.
	Metrics *Metrics
	// Now, when set, replaces time.Now.
	Now func() time.Time
	// DrainDelay (Jumpstarter mode) is how long a disabled Exporter stays
	// unleased before its pod goes; zero means DefaultDrainDelay.
	DrainDelay time.Duration
	// Jumpstarter enables Jumpstarter mode (sets with spec.jumpstarter):
	// SetupWithManager sets it when the API server serves
	// jumpstarter.dev/v1alpha1 Exporters and Leases and the manager's scheme
	// has their types. Without it such sets report ReplicaFailure
	// JumpstarterUnavailable.
	Jumpstarter bool

	expOnce sync.Once
	exp     *expectations
	// written holds, per set, the resourceVersion of this controller's
	// last status write until the cache is known to have seen it.
	written sync.Map // types.NamespacedName -> string
}

// NewReconciler returns a Reconciler with the label lease source.
func NewReconciler(c client.Client, rec events.EventRecorder, m *Metrics) *Reconciler {
	return &Reconciler{Client: c, Recorder: rec, Leases: LabelLeases{}, Metrics: m}
}

// expectations returns the reconciler's expectations, creating them for a
// Reconciler not made by NewReconciler.
func (r *Reconciler) expectations() *expectations {
	r.expOnce.Do(func() {
		if r.exp == nil {
			r.exp = newExpectations()
		}
	})
	return r.exp
}

func (r *Reconciler) reader() client.Reader {
	if r.Reader != nil {
		return r.Reader
	}
	return r.Client
}

func (r *Reconciler) now() time.Time {
	if r.Now != nil {
		return r.Now()
	}
	return time.Now()
}

// SetupWithManager registers the controller: it watches ExporterSets (spec
// changes) and the pods they control. workers is the number of sets
// reconciled in parallel.
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager, workers int) error {
	if r.APIReader == nil {
		r.APIReader = mgr.GetAPIReader()
	}
	owner := handler.EnqueueRequestForOwner(mgr.GetScheme(), mgr.GetRESTMapper(), &v1alpha1.ExporterSet{}, handler.OnlyControllerOwner())
	if err := mgr.GetFieldIndexer().IndexField(context.Background(), &v1alpha1.ExporterSet{}, classNameIndex, func(o client.Object) []string {
		if n := o.(*v1alpha1.ExporterSet).Spec.ClassName; n != "" {
			return []string{n}
		}
		return nil
	}); err != nil {
		return fmt.Errorf("index exportersets by %s: %w", classNameIndex, err)
	}
	b := ctrl.NewControllerManagedBy(mgr).
		Named("exporterset").
		For(&v1alpha1.ExporterSet{}, builder.WithPredicates(predicate.GenerationChangedPredicate{})).
		Watches(&corev1.Pod{}, podEvents{exp: r.expectations(), inner: owner, owner: v1alpha1.GroupVersion.String()}).
		// A class change (or its creation, for a set that waited for it)
		// plans the sets naming it again.
		Watches(&v1alpha1.VirtualTargetClass{}, handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
			var sets v1alpha1.ExporterSetList
			if err := mgr.GetClient().List(ctx, &sets, client.InNamespace(o.GetNamespace()), client.MatchingFields{classNameIndex: o.GetName()}); err != nil {
				logf.FromContext(ctx).Error(err, "list exportersets of class", "class", o.GetName())
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
	if js {
		r.Jumpstarter = true
		// An Exporter names its set in a label (a pod's Exporter is owned
		// by the pod); a Lease may concern any Jumpstarter-mode set of its
		// namespace (its selector, or the exporter it landed on).
		b = b.Watches(&jsv1.Exporter{}, handler.EnqueueRequestsFromMapFunc(func(_ context.Context, o client.Object) []reconcile.Request {
			if n := o.GetLabels()[v1alpha1.ExporterSetLabel]; n != "" {
				return []reconcile.Request{{NamespacedName: types.NamespacedName{Namespace: o.GetNamespace(), Name: n}}}
			}
			return nil
		})).Watches(&jsv1.Lease{}, handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
			var sets v1alpha1.ExporterSetList
			if err := mgr.GetClient().List(ctx, &sets, client.InNamespace(o.GetNamespace())); err != nil {
				return nil
			}
			var out []reconcile.Request
			for _, s := range sets.Items {
				if s.Spec.Jumpstarter != nil || s.Spec.ClassName != "" { // a class may make it Jumpstarter mode
					out = append(out, reconcile.Request{NamespacedName: types.NamespacedName{Namespace: s.Namespace, Name: s.Name}})
				}
			}
			return out
		}))
	}
	return b.Complete(r)
}

// podEvents queues the owner of pod events: pods an ExporterSet of
// apiVersion owner controls (ours or upstream's
// virtualtarget.jumpstarter.dev). A delete event also tells the
// expectations that a created pod is gone (expectations.Gone says why add
// and update events settle nothing).
type podEvents struct {
	exp   *expectations
	inner handler.EventHandler
	owner string
}

type queue = workqueue.TypedRateLimitingInterface[reconcile.Request]

func (h podEvents) gone(obj client.Object) {
	ref := metav1.GetControllerOf(obj)
	if ref == nil || ref.Kind != "ExporterSet" || ref.APIVersion != h.owner {
		return
	}
	h.exp.Gone(types.NamespacedName{Namespace: obj.GetNamespace(), Name: ref.Name}, obj.GetName())
}

func (h podEvents) Create(ctx context.Context, e event.CreateEvent, q queue) {
	h.inner.Create(ctx, e, q)
}

func (h podEvents) Update(ctx context.Context, e event.UpdateEvent, q queue) {
	h.inner.Update(ctx, e, q)
}

func (h podEvents) Delete(ctx context.Context, e event.DeleteEvent, q queue) {
	h.gone(e.Object)
	h.inner.Delete(ctx, e, q)
}

func (h podEvents) Generic(ctx context.Context, e event.GenericEvent, q queue) {
	h.inner.Generic(ctx, e, q)
}

// Reconcile makes one plan for one set and applies it.
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	res, err := r.reconcile(ctx, req)
	if err != nil && ctx.Err() != nil && errors.Is(err, context.Canceled) {
		return res, nil // shutting down: the next leader or start plans again
	}
	return res, err
}

func (r *Reconciler) reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	log := logf.FromContext(ctx)
	key := req.NamespacedName
	var set v1alpha1.ExporterSet
	if err := r.reader().Get(ctx, key, &set); err != nil {
		if apierrors.IsNotFound(err) {
			r.expectations().Forget(key)
			r.written.Delete(key)
			r.Metrics.forget(key)
			return ctrl.Result{}, nil
		}
		return ctrl.Result{}, fmt.Errorf("get exporterset %s: %w", key, err)
	}
	if set.DeletionTimestamp != nil {
		return ctrl.Result{}, nil // the garbage collector deletes the pods
	}
	now := r.now()

	// The class: a set that names a missing class (or whose class cannot
	// be applied) creates and deletes nothing.
	var class *v1alpha1.VirtualTargetClass
	if n := set.Spec.ClassName; n != "" {
		class = &v1alpha1.VirtualTargetClass{}
		if err := r.reader().Get(ctx, types.NamespacedName{Namespace: set.Namespace, Name: n}, class); err != nil {
			if !apierrors.IsNotFound(err) {
				return ctrl.Result{}, fmt.Errorf("get virtualtargetclass %s/%s of exporterset %s: %w", set.Namespace, n, key, err)
			}
			class = nil
		}
	}
	res, cerr := Resolve(&set, class)
	if cerr != nil {
		st := statusOf(set.Status)
		st.Conditions = []Condition{{v1alpha1.ConditionReplicaFailure, metav1.ConditionTrue, cerr.Reason, cerr.Message}}
		return ctrl.Result{}, r.writeStatus(ctx, &set, st, "", nil, now)
	}

	sel, err := metav1.LabelSelectorAsSelector(set.Spec.Selector)
	if err == nil && (sel.Empty() || !sel.Matches(labels.Set(set.Spec.Template.Labels))) {
		err = fmt.Errorf("selector %q does not match the template labels %v", sel, set.Spec.Template.Labels)
	}
	if err != nil {
		// Nothing is created or deleted; the counts stay as last observed.
		st := statusOf(set.Status)
		st.Conditions = []Condition{{v1alpha1.ConditionReplicaFailure, metav1.ConditionTrue, "InvalidSelector", err.Error()}}
		return ctrl.Result{}, r.writeStatus(ctx, &set, st, "", res, now)
	}

	obs, done, err := r.observe(ctx, &set, res, sel, now)
	if done || err != nil {
		return ctrl.Result{}, err
	}
	in := plannerInput(&set, res, obs, r.drainDelay(), now)
	acts := Plan(in)
	log.V(1).Info("plan", "create", acts.Create, "delete", len(acts.Delete), "clearUsed", len(acts.ClearUsed), "expireLease", len(acts.ExpireLease), "markUsed", len(acts.MarkUsed),
		"pods", len(in.Pods), "pendingCreates", len(obs.creating), "target", acts.Status.Desired)
	return r.apply(ctx, &set, res, sel, obs, acts, now)
}

// observed is what a reconcile read about a set's pods and their leases:
// what the planner input is made from.
type observed struct {
	// owned are the pods the set controls.
	owned []corev1.Pod
	// leases by pod name, and demand: leases waiting for a pod.
	leases map[string]Lease
	demand int32
	// js is the Jumpstarter state (Jumpstarter mode only); gated the
	// reasons pods still wait at the scheduling gate, by pod name.
	js    *jsState
	gated map[string]string
	// creating and deleting are the expectations: pods created and not
	// yet seen (by name), and UIDs deleted and not yet seen gone.
	creating []string
	deleting map[types.UID]bool
	// hash is the effective set's template hash.
	hash string
}

// observe lists the set's pods and reads their lease state (and, in
// Jumpstarter mode, sets up pods and Exporters). done reports that the
// set cannot be planned and its status was written instead (Jumpstarter
// mode on an API server without Jumpstarter); err is that write's error.
func (r *Reconciler) observe(ctx context.Context, set *v1alpha1.ExporterSet, res *Resolved, sel labels.Selector, now time.Time) (observed, bool, error) {
	var obs observed
	key := client.ObjectKeyFromObject(set)
	eff := res.Set
	var list corev1.PodList
	if err := r.reader().List(ctx, &list, client.InNamespace(set.Namespace), client.MatchingLabelsSelector{Selector: sel}); err != nil {
		return obs, false, fmt.Errorf("list pods of exporterset %s: %w", key, err)
	}
	obs.owned = list.Items[:0]
	for i := range list.Items {
		if metav1.IsControlledBy(&list.Items[i], set) {
			obs.owned = append(obs.owned, list.Items[i])
		}
	}
	obs.creating, obs.deleting = r.expectations().Pending(key, obs.owned, now)
	if eff.Spec.Jumpstarter != nil {
		if !r.Jumpstarter {
			st := statusOf(set.Status)
			st.Conditions = []Condition{{v1alpha1.ConditionReplicaFailure, metav1.ConditionTrue, "JumpstarterUnavailable",
				"spec.jumpstarter (of the set or its class) is set but the API server does not serve jumpstarter.dev/v1alpha1 Exporters and Leases (install Jumpstarter's CRDs and restart the controller)"}}
			return obs, true, r.writeStatus(ctx, set, st, "", res, now)
		}
		js, err := readJumpstarter(ctx, r.reader(), ourJS(eff), obs.owned, now)
		if err != nil {
			return obs, false, err
		}
		obs.js = js
		obs.gated = r.js().setupPods(ctx, ourJS(eff), obs.owned, obs.deleting, js)
		obs.leases, obs.demand = js.leases, int32(len(js.demand))
	} else {
		var src LeaseSource = LabelLeases{}
		if r.Leases != nil {
			src = r.Leases
		}
		var err error
		if obs.leases, obs.demand, err = src.Leases(ctx, eff, obs.owned); err != nil {
			return obs, false, fmt.Errorf("lease state of exporterset %s: %w", key, err)
		}
		for _, p := range obs.owned {
			if l := obs.leases[p.Name]; l.ExpiryErr != nil {
				r.Recorder.Eventf(set, nil, corev1.EventTypeWarning, EventInvalidLeaseExpiry, "Expire", "Pod %s: %v", p.Name, l.ExpiryErr)
			}
		}
	}
	obs.hash = setHash(eff)
	return obs, false, nil
}

// drainDelay is the Reconciler's DrainDelay or its default.
func (r *Reconciler) drainDelay() time.Duration {
	if r.DrainDelay == 0 {
		return DefaultDrainDelay
	}
	return r.DrainDelay
}

// apply carries out a plan: the set patch first (nothing else if it
// fails), then the pod actions, then the status. A cached set older than
// this controller's last write is planned again instead.
func (r *Reconciler) apply(ctx context.Context, set *v1alpha1.ExporterSet, res *Resolved, sel labels.Selector, obs observed, acts Actions, now time.Time) (ctrl.Result, error) {
	log := logf.FromContext(ctx)
	key := client.ObjectKeyFromObject(set)
	eff := res.Set
	if rv, ok := r.written.Load(key); ok && rv == set.ResourceVersion {
		r.written.CompareAndDelete(key, rv) // the cache has seen the write
	} else if ok && (acts.Create > 0 || len(acts.Delete) > 0 || acts.Set != nil) && r.APIReader != nil {
		// The cached set is not the version our last status write made: it
		// may be older (or a later spec change). Act only on the stored one.
		var stored v1alpha1.ExporterSet
		if err := r.APIReader.Get(ctx, key, &stored); err != nil {
			if apierrors.IsNotFound(err) {
				return ctrl.Result{}, nil
			}
			return ctrl.Result{}, fmt.Errorf("get exporterset %s from the API server: %w", key, err)
		}
		if stored.ResourceVersion != set.ResourceVersion {
			log.V(1).Info("cached exporterset is older than the stored one; plan again", "cached", set.ResourceVersion, "stored", stored.ResourceVersion)
			return ctrl.Result{RequeueAfter: 200 * time.Millisecond}, nil
		}
		r.written.CompareAndDelete(key, rv) // the cache has caught up
	}
	if acts.Set != nil {
		// Removals are counted in spec.replicas before any pod goes; if the
		// set changed since it was read, nothing of this plan is applied.
		if err := r.patchSet(ctx, set, acts.Set); err != nil {
			if apierrors.IsConflict(err) || apierrors.IsNotFound(err) {
				log.V(1).Info("exporterset changed since the plan; plan again", "err", err.Error())
				return ctrl.Result{RequeueAfter: 200 * time.Millisecond}, nil
			}
			return ctrl.Result{}, err
		}
		r.written.Store(key, set.ResourceVersion)
		eff.ResourceVersion = set.ResourceVersion
	}
	execErr := r.execute(ctx, eff, key, obs.hash, obs.js, acts, now)
	if execErr != nil {
		acts.Status.Conditions = append(acts.Status.Conditions,
			Condition{v1alpha1.ConditionReplicaFailure, metav1.ConditionTrue, EventFailedCreate, execErr.Error()})
	}
	if err := r.writeStatus(ctx, set, acts.Status, sel.String(), res, now); err != nil {
		if apierrors.IsConflict(err) && execErr == nil {
			// The cached set is older than the stored one (typically our own
			// previous status write): plan again once the cache caught up.
			log.V(1).Info("status conflict; requeue", "err", err.Error())
			return ctrl.Result{RequeueAfter: 200 * time.Millisecond}, nil
		}
		return ctrl.Result{}, errors.Join(execErr, err)
	}
	r.Metrics.observe(key, acts.Status)
	return ctrl.Result{RequeueAfter: acts.RequeueAfter}, execErr
}
