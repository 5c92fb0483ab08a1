package controller

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/rand"
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
		Watches(&corev1.Pod{}, podEvents{exp: r.expectations(), inner: owner}).
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
	if jumpstarterServed(mgr) {
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

// jumpstarterServed reports whether the manager's scheme has Jumpstarter's
// Exporter and Lease types and the API server serves them.
func jumpstarterServed(mgr ctrl.Manager) bool {
	for _, kind := range []string{"Exporter", "Lease"} {
		gvk := jsv1.GroupVersion.WithKind(kind)
		if !mgr.GetScheme().Recognizes(gvk) {
			return false
		}
		if _, err := mgr.GetRESTMapper().RESTMapping(gvk.GroupKind(), gvk.Version); err != nil {
			return false
		}
	}
	return true
}

// podEvents settles expectations from pod events before queueing the owner.
type podEvents struct {
	exp   *expectations
	inner handler.EventHandler
}

type queue = workqueue.TypedRateLimitingInterface[reconcile.Request]

func (h podEvents) observe(obj client.Object, deleted bool) {
	ref := metav1.GetControllerOf(obj)
	if ref == nil || ref.Kind != "ExporterSet" || ref.APIVersion != v1alpha1.GroupVersion.String() {
		return
	}
	h.exp.Observe(types.NamespacedName{Namespace: obj.GetNamespace(), Name: ref.Name}, obj.GetName(), obj.GetUID(), deleted)
}

func (h podEvents) Create(ctx context.Context, e event.CreateEvent, q queue) {
	h.observe(e.Object, false)
	h.inner.Create(ctx, e, q)
}

func (h podEvents) Update(ctx context.Context, e event.UpdateEvent, q queue) {
	h.observe(e.ObjectNew, false)
	h.inner.Update(ctx, e, q)
}

func (h podEvents) Delete(ctx context.Context, e event.DeleteEvent, q queue) {
	h.observe(e.Object, true)
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
	eff := res.Set

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

	var list corev1.PodList
	if err := r.reader().List(ctx, &list, client.InNamespace(set.Namespace), client.MatchingLabelsSelector{Selector: sel}); err != nil {
		return ctrl.Result{}, fmt.Errorf("list pods of exporterset %s: %w", key, err)
	}
	owned := list.Items[:0]
	for i := range list.Items {
		if metav1.IsControlledBy(&list.Items[i], &set) {
			owned = append(owned, list.Items[i])
		}
	}
	var (
		leases map[string]Lease
		demand int32
		js     *jsState
		gated  map[string]string
	)
	if eff.Spec.Jumpstarter != nil {
		if !r.Jumpstarter {
			st := statusOf(set.Status)
			st.Conditions = []Condition{{v1alpha1.ConditionReplicaFailure, metav1.ConditionTrue, "JumpstarterUnavailable",
				"spec.jumpstarter (of the set or its class) is set but the API server does not serve jumpstarter.dev/v1alpha1 Exporters and Leases (install Jumpstarter's CRDs and restart the controller)"}}
			return ctrl.Result{}, r.writeStatus(ctx, &set, st, "", res, now)
		}
		if js, err = readJumpstarter(ctx, r.reader(), eff, owned, now); err != nil {
			return ctrl.Result{}, err
		}
		gated = r.setupPods(ctx, eff, owned, js)
		leases, demand = js.leases, int32(len(js.demand))
	} else {
		var src LeaseSource = LabelLeases{}
		if r.Leases != nil {
			src = r.Leases
		}
		if leases, demand, err = src.Leases(ctx, eff, owned); err != nil {
			return ctrl.Result{}, fmt.Errorf("lease state of exporterset %s: %w", key, err)
		}
		for _, p := range owned {
			if l := leases[p.Name]; l.ExpiryErr != nil {
				r.Recorder.Eventf(&set, nil, corev1.EventTypeWarning, EventInvalidLeaseExpiry, "Expire", "Pod %s: %v", p.Name, l.ExpiryErr)
			}
		}
	}
	pendingCreates, deleting := r.expectations().Pending(key, owned, now)

	hash := setHash(eff)
	in := Input{
		Replicas:             derefOr(eff.Spec.Replicas, 1),
		MinAvailable:         derefOr(eff.Spec.MinAvailable, 0),
		MaxReplicas:          eff.Spec.MaxReplicas,
		Recycle:              eff.Spec.RecyclePolicy,
		Cooldown:             30 * time.Second,
		TemplateHash:         hash,
		WaitForFirstConsumer: res.BindingMode == v1alpha1.BindingModeWaitForFirstConsumer,
		ScaleIn:              eff.Spec.ScaleInPolicy,
		Paused:               eff.Spec.Paused,
		Removing:             parseRemoving(set.Annotations[v1alpha1.RemovingAnnotation]),
		PendingCreates:       pendingCreates,
		Demand:               demand,
		Now:                  now,

		ConsecutiveFailures: set.Status.ConsecutiveFailures,
	}
	if a := eff.Spec.Autohealing; a != nil {
		in.Autohealing = &Autohealing{StartUpFailureThreshold: derefOr(a.StartUpFailureThreshold, 3), MinFailingToStartDuration: 5 * time.Minute}
		if a.MinFailingToStartDuration != nil {
			in.Autohealing.MinFailingToStartDuration = a.MinFailingToStartDuration.Duration
		}
	}
	if c := meta.FindStatusCondition(set.Status.Conditions, v1alpha1.ConditionReplicaFailure); c != nil {
		if prev := (Condition{c.Type, c.Status, c.Reason, c.Message}); IsRepeatedFailure(&prev) {
			in.LastFailure = &prev
		}
	}
	if in.Recycle == "" {
		in.Recycle = v1alpha1.RecyclePolicyReplace
	}
	if eff.Spec.ScaleDownCooldown != nil {
		in.Cooldown = eff.Spec.ScaleDownCooldown.Duration
	}
	if t := set.Status.ScaleDownPendingSince; t != nil {
		in.ScaleDownPendingSince = &t.Time
	}
	if t := set.Status.LastFailureTime; t != nil {
		in.LastFailureTime = &t.Time
	}
	for i := range owned {
		if !deleting[owned[i].UID] {
			ps := podState(&owned[i], leases[owned[i].Name])
			if js != nil {
				ps.Exporter = exporterState(js.exporters[ps.Name])
				ps.GateReason = gated[ps.Name]
			}
			in.Pods = append(in.Pods, ps)
		}
	}
	if js != nil {
		drain := r.DrainDelay
		if drain == 0 {
			drain = DefaultDrainDelay
		}
		in.Jumpstarter = &JumpstarterInput{DrainDelay: drain, Cold: exporterState(js.cold)}
		in.Jumpstarter.Cold.Leased = js.coldLease != ""
	}

	acts := Plan(in)
	log.V(1).Info("plan", "create", acts.Create, "delete", len(acts.Delete), "clearUsed", len(acts.ClearUsed), "expireLease", len(acts.ExpireLease), "markUsed", len(acts.MarkUsed),
		"pods", len(in.Pods), "pendingCreates", pendingCreates, "target", acts.Status.Desired)

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
		if err := r.patchSet(ctx, &set, acts.Set); err != nil {
			if apierrors.IsConflict(err) || apierrors.IsNotFound(err) {
				log.V(1).Info("exporterset changed since the plan; plan again", "err", err.Error())
				return ctrl.Result{RequeueAfter: 200 * time.Millisecond}, nil
			}
			return ctrl.Result{}, err
		}
		r.written.Store(key, set.ResourceVersion)
		eff.ResourceVersion = set.ResourceVersion
	}
	execErr := r.execute(ctx, eff, key, hash, js, acts, now)
	if execErr != nil {
		acts.Status.Conditions = append(acts.Status.Conditions,
			Condition{v1alpha1.ConditionReplicaFailure, metav1.ConditionTrue, EventFailedCreate, execErr.Error()})
	}
	if err := r.writeStatus(ctx, &set, acts.Status, sel.String(), res, now); err != nil {
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

// parseRemoving reads v1alpha1.RemovingAnnotation: sorted UIDs.
func parseRemoving(v string) []types.UID {
	if v == "" {
		return nil
	}
	var out []types.UID
	for _, s := range strings.Split(v, ",") {
		if s = strings.TrimSpace(s); s != "" {
			out = append(out, types.UID(s))
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

// execute applies the plan's pod actions. It returns an error when pods
// could not be created (the request is then retried with rate-limited
// backoff); failed deletes and precondition conflicts are retried on the
// next event or requeue.
func (r *Reconciler) execute(ctx context.Context, set *v1alpha1.ExporterSet, key types.NamespacedName, hash string, js *jsState, acts Actions, now time.Time) error {
	log := logf.FromContext(ctx)
	if js != nil {
		acts.Delete = r.executeJumpstarter(ctx, set, js, acts, now)
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
				r.deleteExporter(ctx, set.Namespace, d.Name)
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
	if err := r.Client.Create(ctx, newExporter(set, pod)); err != nil && !apierrors.IsAlreadyExists(err) {
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

// writeStatus merges the planned status into the set's status and writes it
// when it changed.
func (r *Reconciler) writeStatus(ctx context.Context, set *v1alpha1.ExporterSet, st Status, selector string, res *Resolved, now time.Time) error {
	ns := set.Status.DeepCopy()
	if res != nil { // nil: the class could not be applied; keep what was shown
		ns.Class = res.Class
		switch {
		case res.Parameters == nil:
			ns.Parameters = nil
		case ns.Parameters == nil || !jsonEqual(ns.Parameters.Raw, res.Parameters):
			// (the API server may write the same object differently)
			ns.Parameters = &runtime.RawExtension{Raw: res.Parameters}
		}
	}
	ns.Replicas, ns.DesiredReplicas, ns.ReadyReplicas = st.Replicas, st.Desired, st.Ready
	ns.AvailableReplicas, ns.LeasedReplicas, ns.UpdatedReplicas = st.Available, st.Leased, st.Updated
	ns.PendingLeases = st.PendingLeases
	ns.ConsecutiveFailures = st.ConsecutiveFailures
	ns.ScaleDownPendingSince = metaTime(st.ScaleDownPendingSince)
	ns.LastFailureTime = metaTime(st.LastFailureTime)
	if selector != "" {
		ns.Selector = selector
	}
	ns.ObservedGeneration = set.Generation
	last := map[string]int{} // a later condition of a type overrides an earlier one
	for i, c := range st.Conditions {
		last[c.Type] = i
	}
	for i, c := range st.Conditions {
		if last[c.Type] != i {
			continue
		}
		meta.SetStatusCondition(&ns.Conditions, metav1.Condition{Type: c.Type, Status: c.Status, Reason: c.Reason,
			Message: c.Message, ObservedGeneration: set.Generation, LastTransitionTime: metav1.NewTime(now.Truncate(time.Second))})
	}
	// Equal to the cached status is not enough while the cache has not seen
	// our last write: the stored status may differ from the cached one (e.g.
	// leased 2 -> 1 written, 1 -> 2 planned from a cache still at 2). Then
	// the update is sent; it conflicts on the stale version and the set is
	// planned again once the cache caught up.
	key := client.ObjectKeyFromObject(set)
	if equality.Semantic.DeepEqual(&set.Status, ns) && !r.writePending(key, set.ResourceVersion) {
		return nil
	}
	// A full update (not a merge patch) so that zero counts are written too:
	// the printer columns and the scale subresource read them.
	set.Status = *ns
	if err := r.Client.Status().Update(ctx, set); err != nil {
		return fmt.Errorf("update status of exporterset %s/%s: %w", set.Namespace, set.Name, err)
	}
	r.written.Store(key, set.ResourceVersion)
	return nil
}

// writePending reports whether this controller wrote set key at a
// resourceVersion other than rv (the cached one) and the cache has not been
// seen to catch up.
func (r *Reconciler) writePending(key types.NamespacedName, rv string) bool {
	w, ok := r.written.Load(key)
	return ok && w != rv
}

// jsonEqual reports whether a and b are the same JSON value.
func jsonEqual(a, b []byte) bool {
	var x, y any
	if json.Unmarshal(a, &x) != nil || json.Unmarshal(b, &y) != nil {
		return false
	}
	return equality.Semantic.DeepEqual(x, y)
}

// statusOf converts a stored status back to a planned one.
func statusOf(s v1alpha1.ExporterSetStatus) Status {
	st := Status{Replicas: s.Replicas, Desired: s.DesiredReplicas, Ready: s.ReadyReplicas, Available: s.AvailableReplicas,
		Leased: s.LeasedReplicas, Updated: s.UpdatedReplicas, PendingLeases: s.PendingLeases, ConsecutiveFailures: s.ConsecutiveFailures}
	if s.ScaleDownPendingSince != nil {
		st.ScaleDownPendingSince = &s.ScaleDownPendingSince.Time
	}
	if s.LastFailureTime != nil {
		st.LastFailureTime = &s.LastFailureTime.Time
	}
	return st
}

func metaTime(t *time.Time) *metav1.Time {
	if t == nil {
		return nil
	}
	mt := metav1.NewTime(t.Truncate(time.Second))
	return &mt
}

func derefOr(p *int32, def int32) int32 {
	if p == nil {
		return def
	}
	return *p
}

// podState extracts what the planner needs from a pod.
func podState(p *corev1.Pod, l Lease) PodState {
	s := PodState{
		Name: p.Name, UID: p.UID, ResourceVersion: p.ResourceVersion, Created: p.CreationTimestamp.Time,
		Phase: p.Status.Phase, Terminating: p.DeletionTimestamp != nil,
		Leased: l.Leased, Used: l.Used, LeaseExpires: l.Expires, TemplateHash: p.Labels[v1alpha1.TemplateHashLabel],
		RemoveRequested: p.Annotations[v1alpha1.RemoveAnnotation] == "true",
	}
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
			s.Ready, s.ReadySince = true, c.LastTransitionTime.Time
		}
		if c.Type == corev1.PodReady && c.Status != corev1.ConditionTrue {
			s.NotReadySince = c.LastTransitionTime.Time
		}
	}
	if len(p.Status.ContainerStatuses) > 0 {
		s.RestartCount = p.Status.ContainerStatuses[0].RestartCount
	}
	statuses := append(append([]corev1.ContainerStatus{}, p.Status.InitContainerStatuses...), p.Status.ContainerStatuses...)
	for _, cs := range statuses {
		if w := cs.State.Waiting; w != nil && w.Reason != "" && s.WaitingReason == "" {
			s.WaitingReason, s.WaitingMessage = w.Reason, w.Message
		}
		if t := cs.State.Terminated; t != nil && s.FailedReason == "" && t.ExitCode != 0 {
			s.FailedReason, s.FailedMessage = t.Reason, fmt.Sprintf("container %s exited %d: %s", cs.Name, t.ExitCode, t.Message)
		}
	}
	if p.Status.Reason != "" {
		s.FailedReason, s.FailedMessage = p.Status.Reason, p.Status.Message
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
