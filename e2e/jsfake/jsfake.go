// Package jsfake is the Kubernetes half of a Jumpstarter test double: it
// mirrors the jumpstarter.dev/v1alpha1 Exporter and Lease objects of a real
// API server onto jstest's in-memory controller and router (the gRPC half),
// following upstream's exporter and lease controllers
// (jumpstarter-dev/jumpstarter b1f2bb41, controller/internal/controller):
//
//   - every Exporter gets a token: Secret <name>-exporter (key "token"),
//     status.credential and status.endpoint, like upstream's
//     reconcileStatusCredential/reconcileStatusEndpoint;
//   - Exporter conditions Registered/Online, status.exporterStatus and
//     status.leaseRef follow what the exporter does on the gRPC side;
//   - a Lease without exporterRef is matched against Exporter labels:
//     no match -> Unsatisfiable (NoAccess) and ended; all matches disabled ->
//     Unsatisfiable AllDisabled and ended; none Registered+Online -> Pending
//     Offline; all leased -> Pending NotAvailable; none Available ->
//     Pending NotReady; else the first by name is assigned (Ready=True,
//     status.exporterRef, beginTime) and the lease is owned by its Exporter
//     (upstream sets that controller reference);
//   - spec.release, spec.endTime or beginTime+duration end a lease.
//
// It is level-triggered: every pass reads all objects of its namespace, so
// its own restarts lose nothing. It is for tests only.
package jsfake

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	"github.com/qemu-kubelet/qemu-kubelet/e2e/cluster"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/jstest"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
)

// Jumpstarter's resources.
var (
	ExporterGVR = schema.GroupVersionResource{Group: "jumpstarter.dev", Version: "v1alpha1", Resource: "exporters"}
	LeaseGVR    = schema.GroupVersionResource{Group: "jumpstarter.dev", Version: "v1alpha1", Resource: "leases"}
)

// Mirror runs the Kubernetes side of the double for one namespace.
type Mirror struct {
	ns   string
	ctl  *jstest.Controller
	dyn  dynamic.Interface
	kube kubernetes.Interface
	// Period bounds how long a change takes to be seen when nothing on the
	// gRPC side wakes the loop (the API server side is polled).
	Period time.Duration

	// mu guards tokens, owned by the loop; Token reads it.
	mu     sync.Mutex
	tokens map[string]string // exporter name -> token
	// Assigned counts lease assignments (for tests).
	assigned int
}

// New returns a mirror of namespace ns onto ctl.
func New(ctl *jstest.Controller, dyn dynamic.Interface, kube kubernetes.Interface, ns string) *Mirror {
	return &Mirror{ns: ns, ctl: ctl, dyn: dyn, kube: kube, Period: 100 * time.Millisecond, tokens: map[string]string{}}
}

// Run reconciles until ctx ends. Errors of a pass are reported to logf and
// retried on the next pass.
func (m *Mirror) Run(ctx context.Context, logf func(string, ...any)) {
	t := time.NewTicker(m.Period)
	defer t.Stop()
	for {
		ch := m.ctl.Changed()
		if err := m.Sync(ctx); err != nil && ctx.Err() == nil {
			logf("jsfake: %v", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-ch:
		case <-t.C:
		}
	}
}

// Token returns the token issued to an exporter ("" if none yet).
func (m *Mirror) Token(name string) string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.tokens[name]
}

// Sync is one reconcile pass over all Exporters and Leases of the namespace.
func (m *Mirror) Sync(ctx context.Context) error {
	exps, err := m.dyn.Resource(ExporterGVR).Namespace(m.ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("list exporters: %w", err)
	}
	leases, err := m.dyn.Resource(LeaseGVR).Namespace(m.ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("list leases: %w", err)
	}
	byName := map[string]*unstructured.Unstructured{}
	for i := range exps.Items {
		byName[exps.Items[i].GetName()] = &exps.Items[i]
	}
	if err := m.credentials(ctx, exps.Items); err != nil {
		return err
	}
	sort.Slice(leases.Items, func(i, j int) bool {
		a, b := leases.Items[i].GetCreationTimestamp(), leases.Items[j].GetCreationTimestamp()
		return a.Before(&b)
	})
	// holder: exporter name -> active lease, from the leases' status.
	holder := map[string]string{}
	for i := range leases.Items {
		l := &leases.Items[i]
		if ended, _, _ := unstructured.NestedBool(l.Object, "status", "ended"); ended {
			continue
		}
		if ref, _, _ := unstructured.NestedString(l.Object, "status", "exporterRef", "name"); ref != "" {
			holder[ref] = l.GetName()
		}
	}
	for i := range leases.Items {
		if err := m.lease(ctx, &leases.Items[i], exps.Items, holder); err != nil {
			return err
		}
	}
	for i := range exps.Items {
		if err := m.exporterStatus(ctx, &exps.Items[i], holder[exps.Items[i].GetName()]); err != nil {
			return err
		}
	}
	return nil
}

// credentials issues a token per Exporter and forgets deleted ones.
func (m *Mirror) credentials(ctx context.Context, exps []unstructured.Unstructured) error {
	seen := map[string]bool{}
	for i := range exps {
		e := &exps[i]
		name := e.GetName()
		seen[name] = true
		m.mu.Lock()
		tok, ok := m.tokens[name]
		m.mu.Unlock()
		if ok {
			continue
		}
		secretName := name + "-exporter"
		sec, err := m.kube.CoreV1().Secrets(m.ns).Get(ctx, secretName, metav1.GetOptions{})
		switch {
		case err == nil && len(sec.Data["token"]) > 0:
			tok = string(sec.Data["token"]) // our own restart: keep the issued token
		case err == nil || apierrors.IsNotFound(err):
			tok = randomToken()
			sec = &corev1.Secret{
				ObjectMeta: metav1.ObjectMeta{Name: secretName, Namespace: m.ns, OwnerReferences: []metav1.OwnerReference{{
					APIVersion: "jumpstarter.dev/v1alpha1", Kind: "Exporter", Name: name, UID: e.GetUID()}}},
				Data: map[string][]byte{"token": []byte(tok)},
			}
			if _, err := m.kube.CoreV1().Secrets(m.ns).Create(ctx, sec, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
				return fmt.Errorf("create credential secret %s: %w", secretName, err)
			} else if apierrors.IsAlreadyExists(err) {
				continue // next pass reads it
			}
		default:
			return fmt.Errorf("get credential secret %s: %w", secretName, err)
		}
		m.ctl.AddExporter(m.ns, name, tok)
		m.mu.Lock()
		m.tokens[name] = tok
		m.mu.Unlock()
	}
	m.mu.Lock()
	var gone []string
	for name := range m.tokens {
		if !seen[name] {
			gone = append(gone, name)
			delete(m.tokens, name)
		}
	}
	m.mu.Unlock()
	for _, name := range gone {
		m.ctl.RemoveExporter(m.ns, name)
	}
	return nil
}

// exporterStatus writes credential, endpoint, conditions, exporterStatus
// and leaseRef when they changed.
func (m *Mirror) exporterStatus(ctx context.Context, e *unstructured.Unstructured, lease string) error {
	st, _ := m.ctl.ExporterState(m.ns, e.GetName())
	u := e.DeepCopy()
	_ = unstructured.SetNestedField(u.Object, e.GetName()+"-exporter", "status", "credential", "name")
	_ = unstructured.SetNestedField(u.Object, m.ctl.Endpoint(), "status", "endpoint")
	conds := conditions(u)
	setCond(&conds, "Registered", st.Registered, "Registered", "Unregister")
	setCond(&conds, "Online", st.Online, "Seen", "Offline")
	putConditions(u, conds)
	_ = unstructured.SetNestedField(u.Object, statusName(st.Status, st.Online), "status", "exporterStatus")
	if lease != "" {
		_ = unstructured.SetNestedField(u.Object, lease, "status", "leaseRef", "name")
	} else {
		unstructured.RemoveNestedField(u.Object, "status", "leaseRef")
	}
	if equalStatus(e, u) {
		return nil
	}
	if _, err := m.dyn.Resource(ExporterGVR).Namespace(m.ns).UpdateStatus(ctx, u, metav1.UpdateOptions{}); err != nil && !apierrors.IsConflict(err) && !apierrors.IsNotFound(err) {
		return fmt.Errorf("update exporter %s status: %w", e.GetName(), err)
	}
	return nil
}

// lease reconciles one lease as upstream's LeaseReconciler does.
func (m *Mirror) lease(ctx context.Context, l *unstructured.Unstructured, exps []unstructured.Unstructured, holder map[string]string) error {
	if ended, _, _ := unstructured.NestedBool(l.Object, "status", "ended"); ended {
		return nil
	}
	u := l.DeepCopy()
	// status.ended is required once there is a status.
	_ = unstructured.SetNestedField(u.Object, false, "status", "ended")
	now := time.Now()
	conds := conditions(u)
	ref, _, _ := unstructured.NestedString(u.Object, "status", "exporterRef", "name")
	if ref != "" {
		release, _, _ := unstructured.NestedBool(u.Object, "spec", "release")
		if release || expired(u, now) {
			_ = m.ctl.EndLease(m.ns, u.GetName()) // the gRPC side may not know it (our restart)
			_ = unstructured.SetNestedField(u.Object, true, "status", "ended")
			_ = unstructured.SetNestedField(u.Object, now.UTC().Format(time.RFC3339), "status", "endTime")
			setCondReason(&conds, "Ready", false, "Released", "The lease was released")
			putConditions(u, conds)
			delete(holder, ref)
			return m.updateLease(ctx, l, u)
		}
		// Re-assert the assignment on the gRPC side (our own restart).
		if st, ok := m.ctl.ExporterState(m.ns, ref); ok && st.Lease == "" {
			client, _, _ := unstructured.NestedString(u.Object, "spec", "clientRef", "name")
			_ = m.ctl.AssignLease(m.ns, u.GetName(), ref, client)
		}
		return nil
	}
	if bt, ok := timeField(u, "spec", "beginTime"); ok && bt.After(now) {
		return nil
	}
	selMap, _, _ := unstructured.NestedMap(u.Object, "spec", "selector")
	var sel metav1.LabelSelector
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(selMap, &sel); err != nil {
		return fmt.Errorf("lease %s: selector: %w", u.GetName(), err)
	}
	selector, err := metav1.LabelSelectorAsSelector(&sel)
	if err != nil || selector.Empty() {
		setCondReason(&conds, "Invalid", true, "InvalidSelector", "The selector for the lease is empty, a selector is required")
		return m.endUnsatisfied(ctx, l, u, conds, now)
	}
	var listed, enabled []*unstructured.Unstructured
	for i := range exps {
		if selector.Matches(labels.Set(exps[i].GetLabels())) {
			listed = append(listed, &exps[i])
			if on, found, _ := unstructured.NestedBool(exps[i].Object, "spec", "enabled"); !found || on {
				enabled = append(enabled, &exps[i])
			}
		}
	}
	switch {
	case len(listed) == 0:
		setCondReason(&conds, "Unsatisfiable", true, "NoAccess", "While there are 0 exporters matching the selector, none of them are approved by any policy for your client")
		return m.endUnsatisfied(ctx, l, u, conds, now)
	case len(enabled) == 0:
		setCondReason(&conds, "Unsatisfiable", true, "AllDisabled", fmt.Sprintf("All %d exporters matching the selector are disabled", len(listed)))
		return m.endUnsatisfied(ctx, l, u, conds, now)
	}
	var online, free, ready []*unstructured.Unstructured
	for _, e := range enabled {
		c := conditions(e)
		if meta.IsStatusConditionTrue(c, "Registered") && meta.IsStatusConditionTrue(c, "Online") {
			online = append(online, e)
		}
	}
	for _, e := range online {
		if holder[e.GetName()] == "" {
			free = append(free, e)
		}
	}
	for _, e := range free {
		if s, _, _ := unstructured.NestedString(e.Object, "status", "exporterStatus"); s == "" || s == "Available" || s == "Unspecified" {
			ready = append(ready, e)
		}
	}
	switch {
	case len(online) == 0:
		setCondReason(&conds, "Pending", true, "Offline", fmt.Sprintf("While there are %d available exporters (i.e. %s), none of them are online", len(enabled), enabled[0].GetName()))
	case len(free) == 0:
		setCondReason(&conds, "Pending", true, "NotAvailable", fmt.Sprintf("There are %d approved exporters, (i.e. %s) but all of them are already leased", len(online), online[0].GetName()))
	case len(ready) == 0:
		setCondReason(&conds, "Pending", true, "NotReady", fmt.Sprintf("There are %d online exporters, but none are ready (still cleaning up previous lease)", len(free)))
	default:
		sort.Slice(ready, func(i, j int) bool { return ready[i].GetName() < ready[j].GetName() })
		e := ready[0]
		client, _, _ := unstructured.NestedString(u.Object, "spec", "clientRef", "name")
		if err := m.ctl.AssignLease(m.ns, u.GetName(), e.GetName(), client); err != nil {
			return fmt.Errorf("lease %s: %w", u.GetName(), err)
		}
		m.mu.Lock()
		m.assigned++
		m.mu.Unlock()
		holder[e.GetName()] = u.GetName()
		_ = unstructured.SetNestedField(u.Object, e.GetName(), "status", "exporterRef", "name")
		_ = unstructured.SetNestedField(u.Object, now.UTC().Format(time.RFC3339), "status", "beginTime")
		setCondReason(&conds, "Ready", true, "Ready", "An exporter has been acquired for the client")
		putConditions(u, conds)
		// Upstream: the lease's controller is its exporter.
		u.SetOwnerReferences([]metav1.OwnerReference{{APIVersion: "jumpstarter.dev/v1alpha1", Kind: "Exporter", Name: e.GetName(), UID: e.GetUID(), Controller: ptr(true), BlockOwnerDeletion: ptr(true)}})
		upd, err := m.dyn.Resource(LeaseGVR).Namespace(m.ns).Update(ctx, u, metav1.UpdateOptions{})
		if err != nil {
			_ = m.ctl.EndLease(m.ns, u.GetName())
			delete(holder, e.GetName())
			return ignoreConflict(err, "own lease "+u.GetName())
		}
		u.SetResourceVersion(upd.GetResourceVersion())
		if _, err := m.dyn.Resource(LeaseGVR).Namespace(m.ns).UpdateStatus(ctx, u, metav1.UpdateOptions{}); err != nil {
			_ = m.ctl.EndLease(m.ns, u.GetName())
			delete(holder, e.GetName())
			return ignoreConflict(err, "assign lease "+u.GetName())
		}
		return nil
	}
	putConditions(u, conds)
	return m.updateLease(ctx, l, u)
}

// Assigned is the number of lease assignments made so far.
func (m *Mirror) Assigned() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.assigned
}

func (m *Mirror) endUnsatisfied(ctx context.Context, l, u *unstructured.Unstructured, conds []metav1.Condition, now time.Time) error {
	putConditions(u, conds)
	_ = unstructured.SetNestedField(u.Object, true, "status", "ended")
	_ = unstructured.SetNestedField(u.Object, now.UTC().Format(time.RFC3339), "status", "endTime")
	return m.updateLease(ctx, l, u)
}

func (m *Mirror) updateLease(ctx context.Context, old, u *unstructured.Unstructured) error {
	if equalStatus(old, u) {
		return nil
	}
	if _, err := m.dyn.Resource(LeaseGVR).Namespace(m.ns).UpdateStatus(ctx, u, metav1.UpdateOptions{}); err != nil {
		return ignoreConflict(err, "update lease "+u.GetName())
	}
	return nil
}

func ignoreConflict(err error, what string) error {
	if apierrors.IsConflict(err) || apierrors.IsNotFound(err) {
		return nil // the next pass sees the newer object
	}
	return fmt.Errorf("%s: %w", what, err)
}

func expired(u *unstructured.Unstructured, now time.Time) bool {
	if et, ok := timeField(u, "spec", "endTime"); ok {
		return et.Before(now)
	}
	ds, _, _ := unstructured.NestedString(u.Object, "spec", "duration")
	if ds == "" {
		return false
	}
	d, err := time.ParseDuration(ds)
	if err != nil {
		return false
	}
	begin, ok := timeField(u, "spec", "beginTime")
	if !ok {
		if begin, ok = timeField(u, "status", "beginTime"); !ok {
			return false
		}
	}
	return begin.Add(d).Before(now)
}

func timeField(u *unstructured.Unstructured, path ...string) (time.Time, bool) {
	s, _, _ := unstructured.NestedString(u.Object, path...)
	if s == "" {
		return time.Time{}, false
	}
	t, err := time.Parse(time.RFC3339, s)
	return t, err == nil
}

func conditions(u *unstructured.Unstructured) []metav1.Condition {
	raw, _, _ := unstructured.NestedSlice(u.Object, "status", "conditions")
	var out []metav1.Condition
	for _, r := range raw {
		var c metav1.Condition
		if m, ok := r.(map[string]any); ok && runtime.DefaultUnstructuredConverter.FromUnstructured(m, &c) == nil {
			out = append(out, c)
		}
	}
	return out
}

func putConditions(u *unstructured.Unstructured, conds []metav1.Condition) {
	raw := make([]any, 0, len(conds))
	for i := range conds {
		m, err := runtime.DefaultUnstructuredConverter.ToUnstructured(&conds[i])
		if err == nil {
			raw = append(raw, m)
		}
	}
	_ = unstructured.SetNestedSlice(u.Object, raw, "status", "conditions")
}

func setCond(conds *[]metav1.Condition, typ string, ok bool, trueReason, falseReason string) {
	reason := falseReason
	if ok {
		reason = trueReason
	}
	setCondReason(conds, typ, ok, reason, reason)
}

func setCondReason(conds *[]metav1.Condition, typ string, ok bool, reason, msg string) {
	st := metav1.ConditionFalse
	if ok {
		st = metav1.ConditionTrue
	}
	meta.SetStatusCondition(conds, metav1.Condition{Type: typ, Status: st, Reason: reason, Message: msg})
}

// statusName is upstream's exporterStatus string of a reported status.
func statusName(s pb.ExporterStatus, online bool) string {
	if !online {
		return "Offline"
	}
	switch s {
	case pb.ExporterStatus_EXPORTER_STATUS_AVAILABLE:
		return "Available"
	case pb.ExporterStatus_EXPORTER_STATUS_LEASE_READY:
		return "LeaseReady"
	case pb.ExporterStatus_EXPORTER_STATUS_BEFORE_LEASE_HOOK:
		return "BeforeLeaseHook"
	case pb.ExporterStatus_EXPORTER_STATUS_AFTER_LEASE_HOOK:
		return "AfterLeaseHook"
	case pb.ExporterStatus_EXPORTER_STATUS_OFFLINE:
		return "Offline"
	default:
		return "Unspecified"
	}
}

func equalStatus(a, b *unstructured.Unstructured) bool {
	sa, _, _ := unstructured.NestedFieldNoCopy(a.Object, "status")
	sb, _, _ := unstructured.NestedFieldNoCopy(b.Object, "status")
	return fmt.Sprint(normalize(sa)) == fmt.Sprint(normalize(sb))
}

// normalize drops condition timestamps so a rewrite that changes nothing
// else is not a change.
func normalize(v any) any {
	m, ok := v.(map[string]any)
	if !ok {
		return v
	}
	out := map[string]any{}
	for k, x := range m {
		if k == "conditions" {
			if cs, ok := x.([]any); ok {
				var cc []any
				for _, c := range cs {
					if cm, ok := c.(map[string]any); ok {
						cm2 := map[string]any{}
						for ck, cv := range cm {
							if ck != "lastTransitionTime" {
								cm2[ck] = cv
							}
						}
						cc = append(cc, cm2)
					}
				}
				x = cc
			}
		}
		out[k] = x
	}
	return out
}

func randomToken() string {
	b := make([]byte, 24)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}

func ptr[T any](v T) *T { return &v }

// CRDDir is where Jumpstarter's CRDs are: shared/jumpstarter/crds beside
// the repository (upstream's generated CRDs, data only).
func CRDDir() (string, error) {
	root, err := cluster.RepoRoot()
	if err != nil {
		return "", err
	}
	dir := filepath.Join(root, "..", "shared", "jumpstarter", "crds")
	if _, err := os.Stat(filepath.Join(dir, "jumpstarter.dev_exporters.yaml")); err != nil {
		return "", fmt.Errorf("jumpstarter CRDs not found beside the repository (%s): %w", dir, err)
	}
	return dir, nil
}

// InstallCRDs applies Jumpstarter's CRDs to c and waits until they are
// established.
func InstallCRDs(ctx context.Context, c *cluster.Cluster) error {
	dir, err := CRDDir()
	if err != nil {
		return err
	}
	if out, err := c.Kubectl(ctx, "apply", "--server-side", "-f", dir); err != nil {
		return fmt.Errorf("install jumpstarter CRDs: %w: %s", err, out)
	}
	if out, err := c.Kubectl(ctx, "wait", "--for=condition=Established", "--timeout=60s",
		"crd/exporters.jumpstarter.dev", "crd/leases.jumpstarter.dev", "crd/clients.jumpstarter.dev"); err != nil {
		return fmt.Errorf("wait for jumpstarter CRDs: %w: %s", err, out)
	}
	return nil
}
