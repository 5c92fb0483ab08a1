package controller

import (
	"context"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"sort"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/rand"
	"k8s.io/client-go/tools/events"
	"sigs.k8s.io/controller-runtime/pkg/client"
	logf "sigs.k8s.io/controller-runtime/pkg/log"

	jsv1 "github.com/qemu-kubelet/qemu-kubelet/api/jumpstarter/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
)

// DefaultDrainDelay is how long a disabled Exporter must stay unleased
// before its pod and Exporter are deleted (Reconciler.DrainDelay).
// Jumpstarter's lease controller chooses an exporter from its cache and then
// writes the Lease: a choice made just before our disable reached its cache
// still lands. The delay covers that window; the uncached check right
// before the delete catches what lands within it.
const DefaultDrainDelay = 2 * time.Second

// Event reasons of Jumpstarter mode.
const (
	EventLeaseDemand      = "LeaseDemand"
	EventExporterDisabled = "ExporterDisabled"
	EventExporterEnabled  = "ExporterEnabled"
	EventLeaseKeptPod     = "LeaseKeptPod"
)

// coldExporterName is the name of a set's cold exporter. Pod names are the
// set's name, a dash and 5 random characters, so they never collide.
func coldExporterName(set string) string { return set + "-cold" }

// exporterSecretName is the name of the per-pod exporter Secret (the
// contract of v1alpha1.JumpstarterSecretAnnotation). Jumpstarter's own
// credential Secret is "<exporter>-exporter".
func exporterSecretName(pod string) string { return pod + "-jumpstarter" }

// jsTarget is the set Jumpstarter mode works for, one of ours or an upstream
// (virtualtarget.jumpstarter.dev) one: what the Exporter steps read of it.
type jsTarget struct {
	// Obj is the set (events go to it); Owner its controller reference
	// (the cold exporter's).
	Obj   client.Object
	Owner metav1.OwnerReference
	// Spec holds the exporter labels, endpoint, CA and guest login.
	Spec  *v1alpha1.JumpstarterSpec
	Reuse bool
	// SetLabel is the label key naming the set on its Exporters and
	// exporter Secrets; SecretName names a pod's exporter Secret.
	SetLabel   string
	SecretName func(pod string) string
	// ExporterConfig, when set, is the config.yaml (upstream's
	// ExporterConfig) the exporter Secret holds besides our keys
	// (upstream_exporterconfig.go).
	ExporterConfig func(namespace, name, endpoint string, token []byte) ([]byte, error)
}

// ourJS is one of our own Jumpstarter-mode sets (the effective one).
func ourJS(set *v1alpha1.ExporterSet) jsTarget {
	return jsTarget{Obj: set, Owner: *metav1.NewControllerRef(set, v1alpha1.GroupVersion.WithKind("ExporterSet")),
		Spec: set.Spec.Jumpstarter, Reuse: set.Spec.RecyclePolicy == v1alpha1.RecyclePolicyReuse,
		SetLabel: v1alpha1.ExporterSetLabel, SecretName: exporterSecretName}
}

// jsClient carries out the Exporter steps: Client writes, Reader reads
// uncached (credentials, the check before a delete), events go to
// Recorder.
type jsClient struct {
	Client   client.Client
	Reader   client.Reader
	Recorder events.EventRecorder
}

func (r *Reconciler) js() jsClient {
	return jsClient{Client: r.Client, Reader: r.apiReader(), Recorder: r.Recorder}
}

// jsState is what Jumpstarter says about one set.
type jsState struct {
	leases    map[string]Lease          // by pod name
	exporters map[string]*jsv1.Exporter // pod exporters by name (= pod name)
	cold      *jsv1.Exporter
	// listed are the Exporters labelled with the set, the cold one aside
	// (what sweepExporters looks at).
	listed    []PodExporter
	coldLease string   // a lease held by the cold exporter (never expected)
	demand    []string // pending Leases that select the set, sorted
}

// JumpstarterLeases is the Jumpstarter lease source: a pod is leased while
// its Exporter (same name) has status.leaseRef or an unended Lease names it
// in status.exporterRef (Jumpstarter writes the Lease first, the Exporter's
// leaseRef after); it is used once any Lease, ended or not, named it (the
// Lease objects outlive the lease, so a lease that began and ended between
// two reconciles still retires a Replace pod). Demand is the number of
// pending Leases: not ended, no exporter assigned, no exporter asked for by
// name, begin time reached or unset, selector matching the set's exporter
// labels.
type JumpstarterLeases struct {
	Reader client.Reader
	Now    func() time.Time
}

// Leases implements LeaseSource.
func (j JumpstarterLeases) Leases(ctx context.Context, set *v1alpha1.ExporterSet, pods []corev1.Pod) (map[string]Lease, int32, error) {
	now := time.Now
	if j.Now != nil {
		now = j.Now
	}
	st, err := readJumpstarter(ctx, j.Reader, ourJS(set), pods, now())
	if err != nil {
		return nil, 0, err
	}
	return st.leases, int32(len(st.demand)), nil
}

func readJumpstarter(ctx context.Context, rd client.Reader, set jsTarget, pods []corev1.Pod, now time.Time) (*jsState, error) {
	ns, name := set.Obj.GetNamespace(), set.Obj.GetName()
	var exps jsv1.ExporterList
	if err := rd.List(ctx, &exps, client.InNamespace(ns), client.MatchingLabels{set.SetLabel: name}); err != nil {
		return nil, fmt.Errorf("list exporters of exporterset %s/%s: %w", ns, name, err)
	}
	var ls jsv1.LeaseList
	if err := rd.List(ctx, &ls, client.InNamespace(ns)); err != nil {
		return nil, fmt.Errorf("list leases in namespace %s: %w", ns, err)
	}
	st := &jsState{leases: map[string]Lease{}, exporters: map[string]*jsv1.Exporter{}}
	for i := range exps.Items {
		e := &exps.Items[i]
		if e.Name == coldExporterName(name) && e.Labels[v1alpha1.ExporterPodLabel] == v1alpha1.ExporterPodCold {
			st.cold = e
			continue
		}
		st.listed = append(st.listed, podExporter(e, set.SetLabel))
		if e.Labels[v1alpha1.ExporterPodLabel] == e.Name {
			st.exporters[e.Name] = e
		}
	}
	want := labels.Set(set.Spec.ExporterLabels)
	// Leases one of the set's Exporters names in status.leaseRef are leased,
	// never demand, even while the Lease informer has not yet delivered
	// their assignment (the Exporter and Lease watches are not ordered with
	// each other): counting one lease twice would create a pod too many.
	onExporter := map[string]bool{}
	for i := range exps.Items {
		if ref := exps.Items[i].Status.LeaseRef; ref != nil {
			onExporter[ref.Name] = true
		}
	}
	holder, used := map[string]string{}, map[string]bool{}
	for i := range ls.Items {
		l := &ls.Items[i]
		if ref := l.Status.ExporterRef; ref != nil && ref.Name != "" {
			used[ref.Name] = true
			if !l.Status.Ended {
				holder[ref.Name] = l.Name
			}
			continue
		}
		if !onExporter[l.Name] && pendingFor(l, want, now) {
			st.demand = append(st.demand, l.Name)
		}
	}
	sort.Strings(st.demand)
	if st.cold != nil {
		st.coldLease = holder[st.cold.Name]
		if st.coldLease == "" && st.cold.Status.LeaseRef != nil {
			st.coldLease = st.cold.Status.LeaseRef.Name
		}
	}
	reuse := set.Reuse
	for i := range pods {
		p := &pods[i]
		l := Lease{Holder: holder[p.Name]}
		if e := st.exporters[p.Name]; e != nil && e.Status.LeaseRef != nil && l.Holder == "" {
			l.Holder = e.Status.LeaseRef.Name
		}
		l.Leased = l.Holder != ""
		if !reuse {
			_, marked := p.Labels[v1alpha1.UsedLabel]
			l.Used = marked || used[p.Name]
		}
		st.leases[p.Name] = l
	}
	return st, nil
}

// pendingFor reports whether a Lease waits for an exporter with the labels
// want: Jumpstarter would assign it to one of the set's exporters once one
// is Online.
func pendingFor(l *jsv1.Lease, want labels.Set, now time.Time) bool {
	if l.Status.Ended || l.Status.ExporterRef != nil || l.DeletionTimestamp != nil || l.Spec.Release || l.Spec.ExporterRef != nil {
		return false
	}
	if b := l.Spec.BeginTime; b != nil && b.After(now) {
		return false
	}
	if meta.IsStatusConditionTrue(l.Status.Conditions, jsv1.LeaseConditionUnsatisfiable) || meta.IsStatusConditionTrue(l.Status.Conditions, "Invalid") {
		return false // Jumpstarter ends it
	}
	sel, err := metav1.LabelSelectorAsSelector(&l.Spec.Selector)
	if err != nil || sel.Empty() {
		return false
	}
	return sel.Matches(want)
}

// podExporter converts an Exporter labelled with a set for the planner's
// sweep; setLabel is the label naming the set.
func podExporter(e *jsv1.Exporter, setLabel string) PodExporter {
	f := PodExporter{Name: e.Name, UID: e.UID, Set: e.Labels[setLabel], Pod: e.Labels[v1alpha1.ExporterPodLabel]}
	if ref := metav1.GetControllerOf(e); ref != nil && ref.Kind == "Pod" && ref.APIVersion == "v1" {
		f.PodUID = ref.UID
	}
	return f
}

// sweepInput fills in what sweepExporters looks at: the set's name, its
// listed Exporters and the expectations (pods created and not yet seen,
// pods deleted and still seen).
func (st *jsState) sweepInput(in *JumpstarterInput, set string, creating []string, deleting map[types.UID]bool) {
	in.Set, in.Exporters, in.Creating = set, st.listed, creating
	in.Deleting = make([]types.UID, 0, len(deleting))
	for uid := range deleting {
		in.Deleting = append(in.Deleting, uid)
	}
	sort.Slice(in.Deleting, func(i, j int) bool { return in.Deleting[i] < in.Deleting[j] })
}

// exporterState converts an Exporter for the planner.
func exporterState(e *jsv1.Exporter) ExporterState {
	if e == nil {
		return ExporterState{}
	}
	s := ExporterState{Found: true, Enabled: e.IsEnabled(), ResourceVersion: e.ResourceVersion}
	if v := e.Annotations[v1alpha1.ExporterDisabledAtAnnotation]; v != "" {
		if t, err := time.Parse(time.RFC3339Nano, v); err == nil {
			s.DisabledAt = t
		}
	}
	return s
}

// setHash is the hash pods of the set carry: the template's, and in
// Jumpstarter mode the Jumpstarter settings' too (a new endpoint or label
// set rolls the pods, whose Secrets and Exporters carry the old ones).
func setHash(set *v1alpha1.ExporterSet) string {
	if set.Spec.Jumpstarter == nil {
		return TemplateHash(&set.Spec.Template)
	}
	h := fnv.New32a()
	b, _ := json.Marshal(struct {
		T *corev1.PodTemplateSpec
		J *v1alpha1.JumpstarterSpec
	}{&set.Spec.Template, set.Spec.Jumpstarter})
	h.Write(b)
	return rand.SafeEncodeString(strconv.FormatUint(uint64(h.Sum32()), 10))
}

// exporterLabels are the labels of an Exporter of the set.
func exporterLabels(set jsTarget, pod string) map[string]string {
	l := make(map[string]string, len(set.Spec.ExporterLabels)+2)
	for k, v := range set.Spec.ExporterLabels {
		l[k] = v
	}
	l[set.SetLabel] = set.Obj.GetName()
	l[v1alpha1.ExporterPodLabel] = pod
	return l
}

// newExporter builds the Exporter of a pod (owned by the pod: the garbage
// collector deletes it with the pod, and with the set through the pod) or,
// with pod nil, the set's cold exporter (owned by the set).
func newExporter(set jsTarget, pod *corev1.Pod) *jsv1.Exporter {
	e := &jsv1.Exporter{
		ObjectMeta: metav1.ObjectMeta{Namespace: set.Obj.GetNamespace()},
		Spec:       jsv1.ExporterSpec{Enabled: new(true)},
	}
	if pod == nil {
		e.Name = coldExporterName(set.Obj.GetName())
		e.Labels = exporterLabels(set, v1alpha1.ExporterPodCold)
		e.OwnerReferences = []metav1.OwnerReference{set.Owner}
		return e
	}
	e.Name = pod.Name
	e.Labels = exporterLabels(set, pod.Name)
	e.OwnerReferences = []metav1.OwnerReference{*metav1.NewControllerRef(pod, corev1.SchemeGroupVersion.WithKind("Pod"))}
	return e
}

// setupPods brings each live pod of a Jumpstarter-mode set one step
// towards running (not the pods deleted by this controller that the cache
// still shows: deleting): its Exporter is created if missing; once Jumpstarter
// issued the Exporter's credential (and endpoint), the pod's exporter
// Secret is written and the scheduling gate removed. It returns, per pod
// still gated, why.
func (r jsClient) setupPods(ctx context.Context, set jsTarget, pods []corev1.Pod, deleting map[types.UID]bool, st *jsState) map[string]string {
	log := logf.FromContext(ctx)
	gated := map[string]string{}
	for i := range pods {
		p := &pods[i]
		if p.DeletionTimestamp != nil || deleting[p.UID] || p.Status.Phase == corev1.PodFailed || p.Status.Phase == corev1.PodSucceeded {
			continue // going anyway (or gone, deleted by us and still cached): no Exporter to make for it
		}
		e := st.exporters[p.Name]
		if e == nil {
			e = newExporter(set, p)
			if err := r.Client.Create(ctx, e); err != nil && !apierrors.IsAlreadyExists(err) {
				log.Info("create exporter", "exporter", e.Name, "err", err.Error())
				if hasGate(p) {
					gated[p.Name] = fmt.Sprintf("creating Exporter %s failed: %v", e.Name, err)
				}
				continue
			}
			st.exporters[p.Name] = e
		}
		if !hasGate(p) {
			continue
		}
		if reason := r.writeExporterSecret(ctx, set, p, e); reason != "" {
			gated[p.Name] = reason
			continue
		}
		patch := client.MergeFromWithOptions(p.DeepCopy(), client.MergeFromWithOptimisticLock{})
		var keep []corev1.PodSchedulingGate
		for _, g := range p.Spec.SchedulingGates {
			if g.Name != v1alpha1.JumpstarterGate {
				keep = append(keep, g)
			}
		}
		p.Spec.SchedulingGates = keep
		if err := r.Client.Patch(ctx, p, patch); err != nil && !apierrors.IsNotFound(err) {
			if !apierrors.IsConflict(err) { // conflict: a cached pod older than ours, removed already
				gated[p.Name] = fmt.Sprintf("removing the scheduling gate failed: %v", err)
			}
			continue
		}
		log.V(1).Info("exporter secret written; scheduling gate removed", "pod", p.Name)
	}
	return gated
}

func hasGate(p *corev1.Pod) bool {
	for _, g := range p.Spec.SchedulingGates {
		if g.Name == v1alpha1.JumpstarterGate {
			return true
		}
	}
	return false
}

// writeExporterSecret writes the pod's exporter Secret from the Exporter's
// credential. It returns why it could not ("" when written).
func (r jsClient) writeExporterSecret(ctx context.Context, set jsTarget, p *corev1.Pod, e *jsv1.Exporter) string {
	if e.Status.Credential == nil || e.Status.Credential.Name == "" {
		return fmt.Sprintf("Exporter %s has no status.credential yet", e.Name)
	}
	endpoint := set.Spec.Endpoint
	if endpoint == "" {
		endpoint = e.Status.Endpoint
	}
	if endpoint == "" {
		return fmt.Sprintf("Exporter %s has no status.endpoint yet and spec.jumpstarter.endpoint is empty", e.Name)
	}
	// The credential Secret is read uncached: the controller does not watch
	// (nor cache) every Secret of the cluster.
	var cred corev1.Secret
	if err := r.Reader.Get(ctx, types.NamespacedName{Namespace: e.Namespace, Name: e.Status.Credential.Name}, &cred); err != nil {
		return fmt.Sprintf("reading credential Secret %s of Exporter %s failed: %v", e.Status.Credential.Name, e.Name, err)
	}
	token := cred.Data["token"]
	if len(token) == 0 {
		return fmt.Sprintf("credential Secret %s of Exporter %s has no key token", cred.Name, e.Name)
	}
	data := map[string][]byte{
		v1alpha1.JumpstarterSecretEndpoint:  []byte(endpoint),
		v1alpha1.JumpstarterSecretToken:     token,
		v1alpha1.JumpstarterSecretNamespace: []byte(e.Namespace),
		v1alpha1.JumpstarterSecretName:      []byte(e.Name),
	}
	if ca := set.Spec.CABundle; ca != "" {
		data[v1alpha1.JumpstarterSecretCA] = []byte(ca)
	}
	user, pass, reason := r.guestLogin(ctx, set, p) // guestlogin.go
	if reason != "" {
		return reason
	}
	if user != nil {
		data[v1alpha1.JumpstarterSecretUsername], data[v1alpha1.JumpstarterSecretPassword] = user, pass
	}
	if set.ExporterConfig != nil {
		doc, err := set.ExporterConfig(e.Namespace, e.Name, endpoint, token)
		if err != nil {
			return fmt.Sprintf("building the ExporterConfig of Exporter %s failed: %v", e.Name, err)
		}
		data[jsv1.ExporterConfigSecretKey] = doc
	}
	name := p.Annotations[v1alpha1.JumpstarterSecretAnnotation]
	if name == "" {
		return fmt.Sprintf("pod has no %s annotation", v1alpha1.JumpstarterSecretAnnotation)
	}
	sec := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Namespace: p.Namespace, Name: name, Labels: map[string]string{set.SetLabel: set.Obj.GetName()},
			OwnerReferences: []metav1.OwnerReference{*metav1.NewControllerRef(p, corev1.SchemeGroupVersion.WithKind("Pod"))}},
		Type: corev1.SecretTypeOpaque,
		Data: data,
	}
	err := r.Client.Create(ctx, sec)
	if apierrors.IsAlreadyExists(err) {
		// A previous pass wrote it (and failed to remove the gate), or the
		// token changed: overwrite what it holds.
		var cur corev1.Secret
		if err = r.Reader.Get(ctx, client.ObjectKeyFromObject(sec), &cur); err == nil {
			if !metav1.IsControlledBy(&cur, p) {
				return fmt.Sprintf("Secret %s exists and is not owned by the pod", name)
			}
			cur.Data = data
			err = r.Client.Update(ctx, &cur)
		}
	}
	if err != nil {
		return fmt.Sprintf("writing exporter Secret %s failed: %v", name, err)
	}
	return ""
}

func (r *Reconciler) apiReader() client.Reader {
	if r.APIReader != nil {
		return r.APIReader
	}
	return r.Client
}

// patchExporter sets spec.enabled (and the disabled-at mark) on an
// Exporter with a resourceVersion precondition.
func (r jsClient) patchExporter(ctx context.Context, ns string, ref ExporterRef, enable bool, now time.Time) error {
	at := "null"
	if !enable {
		at = strconv.Quote(now.UTC().Format(time.RFC3339Nano))
	}
	patch := fmt.Appendf(nil, `{"metadata":{"resourceVersion":%q,"annotations":{%q:%s}},"spec":{"enabled":%t}}`,
		ref.ResourceVersion, v1alpha1.ExporterDisabledAtAnnotation, at, enable)
	e := &jsv1.Exporter{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: ref.Name}}
	return r.Client.Patch(ctx, e, client.RawPatch(types.MergePatchType, patch))
}

// stillLeaseFree reads the Exporter and the namespace's Leases from the API
// server (not the cache) right before a delete: the Exporter must still be
// disabled and no unended Lease may name it. It returns the lease that
// holds it, or why it must stay.
func (r jsClient) stillLeaseFree(ctx context.Context, ns, name string, leases *jsv1.LeaseList) (string, error) {
	var e jsv1.Exporter
	if err := r.Reader.Get(ctx, types.NamespacedName{Namespace: ns, Name: name}, &e); err != nil {
		if apierrors.IsNotFound(err) {
			return "", nil
		}
		return "", err
	}
	if e.IsEnabled() {
		return "Exporter enabled again", nil
	}
	if e.Status.LeaseRef != nil {
		return "Lease " + e.Status.LeaseRef.Name, nil
	}
	for i := range leases.Items {
		l := &leases.Items[i]
		if !l.Status.Ended && l.Status.ExporterRef != nil && l.Status.ExporterRef.Name == name {
			return "Lease " + l.Name, nil
		}
	}
	return "", nil
}

// executeJumpstarter applies the exporter actions of a plan and deletes the
// drained pods (with their Exporters) that are still lease-free when read
// from the API server. It returns the deletions the plan may count as done.
func (r jsClient) executeJumpstarter(ctx context.Context, set jsTarget, st *jsState, acts Actions, now time.Time) []Deletion {
	log := logf.FromContext(ctx)
	ns, obj := set.Obj.GetNamespace(), set.Obj
	for _, ref := range acts.Disable {
		err := r.patchExporter(ctx, ns, ref, false, now)
		switch {
		case err == nil:
			r.Recorder.Eventf(obj, nil, corev1.EventTypeNormal, EventExporterDisabled, "Disable", "Disabled Exporter %s before its pod goes", ref.Name)
		case apierrors.IsConflict(err), apierrors.IsNotFound(err):
			log.V(1).Info("exporter changed since the plan; not disabled", "exporter", ref.Name)
		default:
			log.Info("disable exporter", "exporter", ref.Name, "err", err.Error())
		}
	}
	for _, ref := range acts.Enable {
		err := r.patchExporter(ctx, ns, ref, true, now)
		switch {
		case err == nil:
			r.Recorder.Eventf(obj, nil, corev1.EventTypeNormal, EventExporterEnabled, "Enable", "Enabled Exporter %s again: its pod is wanted", ref.Name)
		case apierrors.IsConflict(err), apierrors.IsNotFound(err):
		default:
			log.Info("enable exporter", "exporter", ref.Name, "err", err.Error())
		}
	}
	switch acts.Cold {
	case ColdCreate:
		if err := r.Client.Create(ctx, newExporter(set, nil)); err != nil && !apierrors.IsAlreadyExists(err) {
			log.Info("create cold exporter", "err", err.Error())
		}
	case ColdEnable:
		if err := r.patchExporter(ctx, ns, ExporterRef{Name: st.cold.Name, ResourceVersion: st.cold.ResourceVersion}, true, now); err != nil && !apierrors.IsConflict(err) {
			log.Info("enable cold exporter", "err", err.Error())
		}
	case ColdDelete:
		uid := st.cold.UID
		if err := r.Client.Delete(ctx, st.cold, client.Preconditions{UID: &uid}); err != nil && !apierrors.IsNotFound(err) {
			log.Info("delete cold exporter", "err", err.Error())
		}
	}
	if st.cold != nil && acts.Cold != ColdDelete {
		r.syncColdLabels(ctx, set, st.cold)
	}
	for _, d := range acts.DeleteExporters {
		r.deleteOrphan(ctx, ns, d)
	}
	if len(acts.Delete) == 0 {
		return nil
	}
	var fresh jsv1.LeaseList
	if err := r.Reader.List(ctx, &fresh, client.InNamespace(ns)); err != nil {
		log.Info("list leases before delete; deleting nothing", "err", err.Error())
		return nil
	}
	var ok []Deletion
	for _, d := range acts.Delete {
		if st.exporters[d.Name] != nil {
			why, err := r.stillLeaseFree(ctx, ns, d.Name, &fresh)
			if err != nil {
				log.Info("check exporter before delete; kept", "pod", d.Name, "err", err.Error())
				continue
			}
			if why != "" {
				r.Recorder.Eventf(obj, nil, corev1.EventTypeNormal, EventLeaseKeptPod, "Keep", "Kept pod %s (%s): %s", d.Name, d.Reason, why)
				continue
			}
		}
		ok = append(ok, d)
	}
	return ok
}

// deleteExporter deletes a pod's Exporter after its pod (the garbage
// collector would too, but later).
func (r jsClient) deleteExporter(ctx context.Context, ns, name string) {
	e := &jsv1.Exporter{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}}
	if err := r.Client.Delete(ctx, e); err != nil && !apierrors.IsNotFound(err) {
		logf.FromContext(ctx).Info("delete exporter", "exporter", name, "err", err.Error())
	}
}

// deleteOrphan deletes an Exporter whose pod is gone (sweepExporters),
// unless the API server (not the cache) still has its pod.
func (r jsClient) deleteOrphan(ctx context.Context, ns string, d ExporterDeletion) {
	log := logf.FromContext(ctx).WithValues("exporter", d.Name, "podUID", d.PodUID)
	var p corev1.Pod
	switch err := r.Reader.Get(ctx, types.NamespacedName{Namespace: ns, Name: d.Name}, &p); {
	case err == nil && p.UID == d.PodUID:
		log.V(1).Info("pod of exporter not cached yet but exists; exporter kept")
		return
	case err != nil && !apierrors.IsNotFound(err):
		log.Info("read pod of exporter before deleting it; kept", "err", err.Error())
		return
	}
	e := &jsv1.Exporter{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: d.Name}}
	uid := d.UID
	switch err := r.Client.Delete(ctx, e, client.Preconditions{UID: &uid}); {
	case err == nil:
		log.Info("deleted exporter whose pod is gone")
	case apierrors.IsNotFound(err), apierrors.IsConflict(err): // gone, or another Exporter of that name now
	default:
		log.Info("delete exporter whose pod is gone; retried on the next pass", "err", err.Error())
	}
}

// syncColdLabels keeps the cold exporter's labels those of the set.
func (r jsClient) syncColdLabels(ctx context.Context, set jsTarget, cold *jsv1.Exporter) {
	want := exporterLabels(set, v1alpha1.ExporterPodCold)
	if labels.Equals(want, cold.Labels) {
		return
	}
	l := map[string]*string{}
	for k := range cold.Labels {
		l[k] = nil
	}
	for k, v := range want {
		l[k] = &v
	}
	b, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": l, "resourceVersion": cold.ResourceVersion}})
	if err := r.Client.Patch(ctx, cold, client.RawPatch(types.MergePatchType, b)); err != nil && !apierrors.IsConflict(err) {
		logf.FromContext(ctx).Info("update cold exporter labels", "err", err.Error())
	}
}

// newJumpstarterPod builds a gated pod of a Jumpstarter-mode set. Its name
// is chosen here (not by the API server's generateName) so that the
// annotation can name its Secret at once.
func newJumpstarterPod(set *v1alpha1.ExporterSet, hash string) *corev1.Pod {
	p := newPod(set, hash)
	gateForExporter(p, set.Name, exporterSecretName)
	return p
}

// gateForExporter makes p a gated pod of a Jumpstarter-mode set: named
// now (so that its annotation can name its Secret at once), the Secret
// referenced as a volume, held at the scheduling gate.
func gateForExporter(p *corev1.Pod, set string, secretName func(pod string) string) {
	p.GenerateName = ""
	p.Name = set + "-" + rand.String(5)
	ann := make(map[string]string, len(p.Annotations)+1)
	for k, v := range p.Annotations {
		ann[k] = v
	}
	ann[v1alpha1.JumpstarterSecretAnnotation] = secretName(p.Name)
	p.Annotations = ann
	// The Secret as a volume: the Node authorizer then lets the pod's node
	// (and no other) read it. The node keeps it on the host.
	p.Spec.Volumes = append(p.Spec.Volumes, corev1.Volume{Name: v1alpha1.JumpstarterSecretVolume,
		VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{SecretName: secretName(p.Name)}}})
	p.Spec.SchedulingGates = append(p.Spec.SchedulingGates, corev1.PodSchedulingGate{Name: v1alpha1.JumpstarterGate})
}

// leaseList renders lease names for an event, at most 10.
func leaseList(names []string) string {
	shown := names[:min(len(names), 10)]
	s := strings.Join(shown, ", ")
	if len(names) > len(shown) {
		s += fmt.Sprintf(" and %d more", len(names)-len(shown))
	}
	return s
}
