// Package jsfake is the Kubernetes half of a test Jumpstarter: it mirrors
// the Exporter and Lease objects (jumpstarter.dev/v1alpha1) of one
// namespace of a real API server onto an in-memory jstest.Controller (the
// gRPC half), following the rules of upstream's exporter and lease
// controllers (jumpstarter-dev/jumpstarter b1f2bb41,
// controller/internal/controller):
//
//   - a new Exporter gets a credential: a Secret <name>-exporter with key
//     token (the token jstest accepts), status.credential and
//     status.endpoint (the jstest controller's address);
//   - an Exporter's status follows jstest: conditions Registered and Online,
//     exporterStatus as reported, lastSeen while online, and leaseRef = the
//     unended Lease assigned to it;
//   - a Lease not yet assigned, whose begin time is reached: no Exporter
//     matches its selector -> Unsatisfiable (NoAccess) and ended; all
//     matches disabled -> Unsatisfiable AllDisabled and ended; none online
//     -> Pending Offline; all online ones leased -> Pending NotAvailable;
//     none reporting Available (or unspecified) -> Pending NotReady;
//     otherwise the first by name gets it: status.exporterRef, beginTime,
//     Ready=True (Pending stays as it was, as upstream), and jstest
//     assigns it;
//   - an assigned Lease ends on spec.release or once its end time
//     (spec.endTime, spec.beginTime + duration, or status.beginTime +
//     duration) passed: status.ended, endTime, and jstest ends it.
//
// Access policies, spot access, priorities and the Client objects are not
// mirrored. It makes a pass every Interval, when jstest changes, and, when
// Client can watch (client.WithWatch), at once on any change of a Lease or
// an Exporter of the namespace, as upstream's controllers, which are
// watch-driven, do: a Lease on an online exporter is assigned within one
// pass, not within one Interval.
package jsfake

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	jsv1 "github.com/qemu-kubelet/qemu-kubelet/api/jumpstarter/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/jstest"
)

// Fake mirrors one namespace onto a jstest controller.
type Fake struct {
	// Client reads and writes the API server (its scheme must have
	// jumpstarter.dev/v1alpha1 and core/v1).
	Client client.Client
	// Ctl is the gRPC half.
	Ctl       *jstest.Controller
	Namespace string
	// Interval between passes (default 100 ms).
	Interval time.Duration
	Log      logr.Logger
	// Now, when set, replaces time.Now.
	Now func() time.Time

	added map[string]string // exporter name -> UID mirrored onto Ctl
}

// Run makes passes until ctx ends; errors of a pass are logged and the
// next pass tries again.
func (f *Fake) Run(ctx context.Context) {
	iv := f.Interval
	if iv == 0 {
		iv = 100 * time.Millisecond
	}
	wake := make(chan struct{}, 1)
	if wc, ok := f.Client.(client.WithWatch); ok {
		for _, list := range []client.ObjectList{&jsv1.LeaseList{}, &jsv1.ExporterList{}} {
			go f.watch(ctx, wc, list, wake)
		}
	}
	for {
		if err := f.Sync(ctx); err != nil && ctx.Err() == nil {
			f.Log.Info("jsfake pass", "err", err.Error())
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(iv):
		case <-f.Ctl.Changed():
		case <-wake:
		}
	}
}

// watch signals wake (without blocking: one pending signal is enough) on
// every event of list's kind in the namespace until ctx ends; a watch the
// API server closes is opened again.
func (f *Fake) watch(ctx context.Context, wc client.WithWatch, list client.ObjectList, wake chan<- struct{}) {
	for ctx.Err() == nil {
		w, err := wc.Watch(ctx, list, client.InNamespace(f.Namespace))
		if err != nil {
			if ctx.Err() == nil {
				f.Log.Info("jsfake watch", "kind", fmt.Sprintf("%T", list), "err", err.Error())
			}
		} else {
			for range w.ResultChan() {
				select {
				case wake <- struct{}{}:
				default:
				}
			}
			w.Stop()
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
}

func (f *Fake) now() time.Time {
	if f.Now != nil {
		return f.Now()
	}
	return time.Now()
}

// Sync makes one pass: leases first (assignments and ends), then the
// exporters' status (credential, online, leaseRef).
func (f *Fake) Sync(ctx context.Context) error {
	if f.added == nil {
		f.added = map[string]string{}
	}
	// Leases are listed before exporters: every exporter made before a
	// lease this pass sees is then in the exporter list. The other order
	// let a pass that listed exporters just before a set's cold Exporter
	// was made, and leases after a Lease for it was made, end that Lease
	// as Unsatisfiable (no exporter matches), as seen on a loaded host.
	var leases jsv1.LeaseList
	if err := f.Client.List(ctx, &leases, client.InNamespace(f.Namespace)); err != nil {
		return fmt.Errorf("jsfake: list leases: %w", err)
	}
	var exps jsv1.ExporterList
	if err := f.Client.List(ctx, &exps, client.InNamespace(f.Namespace)); err != nil {
		return fmt.Errorf("jsfake: list exporters: %w", err)
	}
	sort.Slice(exps.Items, func(i, j int) bool { return exps.Items[i].Name < exps.Items[j].Name })
	var errs []error
	byName := map[string]*jsv1.Exporter{}
	seen := map[string]bool{}
	for i := range exps.Items {
		e := &exps.Items[i]
		byName[e.Name] = e
		seen[e.Name] = true
		if err := f.ensureCredential(ctx, e); err != nil {
			errs = append(errs, err)
		}
	}
	for name := range f.added {
		if !seen[name] {
			f.Ctl.RemoveExporter(f.Namespace, name)
			delete(f.added, name)
		}
	}
	holder := map[string]string{} // exporter -> unended lease
	for i := range leases.Items {
		l := &leases.Items[i]
		if !l.Status.Ended && l.Status.ExporterRef != nil {
			holder[l.Status.ExporterRef.Name] = l.Name
		}
	}
	sort.Slice(leases.Items, func(i, j int) bool {
		return leases.Items[i].CreationTimestamp.Before(&leases.Items[j].CreationTimestamp) ||
			leases.Items[i].CreationTimestamp.Equal(&leases.Items[j].CreationTimestamp) && leases.Items[i].Name < leases.Items[j].Name
	})
	for i := range leases.Items {
		l := &leases.Items[i]
		if l.Status.Ended {
			continue
		}
		if err := f.syncLease(ctx, l, exps.Items, holder); err != nil {
			errs = append(errs, err)
		}
	}
	for i := range exps.Items {
		if err := f.syncExporterStatus(ctx, &exps.Items[i], holder[exps.Items[i].Name]); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// ensureCredential mirrors the Exporter onto Ctl with the token of its
// credential Secret (made here if missing).
func (f *Fake) ensureCredential(ctx context.Context, e *jsv1.Exporter) error {
	if f.added[e.Name] == string(e.UID) {
		return nil
	}
	name := e.Name + "-exporter"
	var sec corev1.Secret
	err := f.Client.Get(ctx, types.NamespacedName{Namespace: e.Namespace, Name: name}, &sec)
	switch {
	case err == nil && len(sec.Data["token"]) > 0 && metav1.IsControlledBy(&sec, e):
		f.Ctl.AddExporter(e.Namespace, e.Name, string(sec.Data["token"]))
	case err == nil || apierrors.IsNotFound(err):
		if err == nil { // a previous exporter's: replace it
			if err := f.Client.Delete(ctx, &sec); err != nil && !apierrors.IsNotFound(err) {
				return fmt.Errorf("jsfake: delete stale credential %s: %w", name, err)
			}
		}
		tok := f.Ctl.AddExporter(e.Namespace, e.Name, "")
		sec = corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{Namespace: e.Namespace, Name: name,
				OwnerReferences: []metav1.OwnerReference{*metav1.NewControllerRef(e, jsv1.GroupVersion.WithKind("Exporter"))}},
			Data: map[string][]byte{"token": []byte(tok)},
		}
		if err := f.Client.Create(ctx, &sec); err != nil {
			f.Ctl.RemoveExporter(e.Namespace, e.Name)
			return fmt.Errorf("jsfake: create credential %s: %w", name, err)
		}
	default:
		return fmt.Errorf("jsfake: get credential %s: %w", name, err)
	}
	f.added[e.Name] = string(e.UID)
	return nil
}

// exporterStatusName converts jstest's protocol status to the CRD's enum
// (EXPORTER_STATUS_LEASE_READY -> LeaseReady).
func exporterStatusName(s fmt.Stringer) string {
	parts := strings.Split(strings.TrimPrefix(s.String(), "EXPORTER_STATUS_"), "_")
	for i, p := range parts {
		parts[i] = strings.ToUpper(p[:1]) + strings.ToLower(p[1:])
	}
	return strings.Join(parts, "")
}

func (f *Fake) syncExporterStatus(ctx context.Context, e *jsv1.Exporter, lease string) error {
	st, _ := f.Ctl.ExporterState(e.Namespace, e.Name)
	ns := e.Status.DeepCopy()
	ns.Credential = &corev1.LocalObjectReference{Name: e.Name + "-exporter"}
	ns.Endpoint = f.Ctl.Endpoint()
	ns.LeaseRef = nil
	if lease != "" {
		ns.LeaseRef = &corev1.LocalObjectReference{Name: lease}
	}
	set := func(typ string, ok bool, reason string) {
		s := metav1.ConditionFalse
		if ok {
			s = metav1.ConditionTrue
		}
		meta.SetStatusCondition(&ns.Conditions, metav1.Condition{Type: typ, Status: s, Reason: reason, ObservedGeneration: e.Generation})
	}
	set(jsv1.ExporterConditionRegistered, st.Registered, "Register")
	set(jsv1.ExporterConditionOnline, st.Online, "Seen")
	if st.Online {
		ns.ExporterStatusValue = exporterStatusName(st.Status)
		if f.now().Sub(ns.LastSeen.Time) > 10*time.Second {
			ns.LastSeen = metav1.NewTime(f.now().Truncate(time.Second))
		}
	} else if !ns.LastSeen.IsZero() {
		ns.ExporterStatusValue = "Offline"
	}
	ns.StatusMessage = st.StatusMessage
	if equality.Semantic.DeepEqual(&e.Status, ns) {
		return nil
	}
	e.Status = *ns
	if err := f.Client.Status().Update(ctx, e); err != nil && !apierrors.IsConflict(err) && !apierrors.IsNotFound(err) {
		return fmt.Errorf("jsfake: update status of exporter %s: %w", e.Name, err)
	}
	return nil
}

// expiry is when an assigned lease ends by time (zero: never).
func expiry(l *jsv1.Lease) time.Time {
	switch {
	case l.Spec.EndTime != nil:
		return l.Spec.EndTime.Time
	case l.Spec.BeginTime != nil && l.Spec.Duration != nil:
		return l.Spec.BeginTime.Add(l.Spec.Duration.Duration)
	case l.Status.BeginTime != nil && l.Spec.Duration != nil:
		return l.Status.BeginTime.Add(l.Spec.Duration.Duration)
	}
	return time.Time{}
}

func (f *Fake) syncLease(ctx context.Context, l *jsv1.Lease, exps []jsv1.Exporter, holder map[string]string) error {
	now := f.now()
	old := l.Status.DeepCopy()
	switch {
	case l.Status.ExporterRef != nil:
		if exp := expiry(l); !l.Spec.Release && (exp.IsZero() || now.Before(exp)) {
			return nil
		}
		if err := f.Ctl.EndLease(l.Namespace, l.Name); err != nil {
			f.Log.V(1).Info("end lease in jstest", "lease", l.Name, "err", err.Error())
		}
		l.Status.Ended, l.Status.EndTime = true, &metav1.Time{Time: now}
		meta.SetStatusCondition(&l.Status.Conditions, metav1.Condition{Type: jsv1.LeaseConditionReady, Status: metav1.ConditionFalse, Reason: "Released", Message: "the lease ended"})
		delete(holder, l.Status.ExporterRef.Name)
	case l.Spec.Release:
		l.Status.Ended, l.Status.EndTime = true, &metav1.Time{Time: now}
	case l.Spec.BeginTime != nil && l.Spec.BeginTime.After(now):
		return nil
	default:
		f.assign(l, exps, holder, now)
	}
	if equality.Semantic.DeepEqual(old, &l.Status) {
		return nil
	}
	if err := f.Client.Status().Update(ctx, l); err != nil {
		if l.Status.ExporterRef != nil && old.ExporterRef == nil {
			_ = f.Ctl.EndLease(l.Namespace, l.Name) // not written: undo
			delete(holder, l.Status.ExporterRef.Name)
		}
		if apierrors.IsConflict(err) || apierrors.IsNotFound(err) {
			return nil
		}
		return fmt.Errorf("jsfake: update status of lease %s: %w", l.Name, err)
	}
	return nil
}

func pending(l *jsv1.Lease, reason, msg string) {
	meta.SetStatusCondition(&l.Status.Conditions, metav1.Condition{Type: jsv1.LeaseConditionPending, Status: metav1.ConditionTrue, Reason: reason, Message: msg})
}

func unsatisfiable(l *jsv1.Lease, reason, msg string, now time.Time) {
	meta.SetStatusCondition(&l.Status.Conditions, metav1.Condition{Type: jsv1.LeaseConditionUnsatisfiable, Status: metav1.ConditionTrue, Reason: reason, Message: msg})
	l.Status.Ended, l.Status.EndTime = true, &metav1.Time{Time: now}
}

// assign applies upstream's choice of an exporter for an unassigned lease.
func (f *Fake) assign(l *jsv1.Lease, exps []jsv1.Exporter, holder map[string]string, now time.Time) {
	var matching []jsv1.Exporter
	if ref := l.Spec.ExporterRef; ref != nil {
		for _, e := range exps {
			if e.Name == ref.Name {
				matching = append(matching, e)
			}
		}
		if len(matching) == 0 {
			unsatisfiable(l, "ExporterNotFound", "Requested exporter "+ref.Name+" was not found", now)
			return
		}
		if !matching[0].IsEnabled() && !allowDisabled(l) {
			unsatisfiable(l, "ExporterDisabled", "Requested exporter "+ref.Name+" is disabled", now)
			return
		}
	} else {
		sel, err := metav1.LabelSelectorAsSelector(&l.Spec.Selector)
		if err != nil || sel.Empty() {
			meta.SetStatusCondition(&l.Status.Conditions, metav1.Condition{Type: "Invalid", Status: metav1.ConditionTrue, Reason: "InvalidSelector", Message: "a selector is required"})
			l.Status.Ended, l.Status.EndTime = true, &metav1.Time{Time: now}
			return
		}
		var listed int
		for _, e := range exps {
			if sel.Matches(labels.Set(e.Labels)) {
				listed++
				if e.IsEnabled() {
					matching = append(matching, e)
				}
			}
		}
		if len(matching) == 0 && listed > 0 {
			unsatisfiable(l, "AllDisabled", fmt.Sprintf("All %d exporters matching the selector are disabled", listed), now)
			return
		}
		if len(matching) == 0 {
			unsatisfiable(l, "NoAccess", "While there are 0 exporters matching the selector, none of them are approved by any policy for your client", now)
			return
		}
	}
	var online []jsv1.Exporter
	for _, e := range matching {
		if st, _ := f.Ctl.ExporterState(e.Namespace, e.Name); st.Registered && st.Online {
			online = append(online, e)
		}
	}
	if len(online) == 0 {
		pending(l, "Offline", fmt.Sprintf("While there are %d available exporters (i.e. %s), none of them are online", len(matching), matching[0].Name))
		return
	}
	var free []jsv1.Exporter
	for _, e := range online {
		if holder[e.Name] == "" {
			free = append(free, e)
		}
	}
	if len(free) == 0 {
		pending(l, "NotAvailable", fmt.Sprintf("There are %d approved exporters, (i.e. %s) but all of them are already leased", len(online), online[0].Name))
		return
	}
	var ready []jsv1.Exporter
	for _, e := range free {
		st, _ := f.Ctl.ExporterState(e.Namespace, e.Name)
		if s := exporterStatusName(st.Status); s == "Available" || s == "Unspecified" {
			ready = append(ready, e)
		}
	}
	if len(ready) == 0 {
		pending(l, "NotReady", fmt.Sprintf("There are %d online exporters, but none are ready (still cleaning up previous lease)", len(free)))
		return
	}
	pick := ready[0] // sorted by name
	if err := f.Ctl.AssignLease(l.Namespace, l.Name, pick.Name, l.Spec.ClientRef.Name); err != nil {
		f.Log.Info("assign lease in jstest", "lease", l.Name, "exporter", pick.Name, "err", err.Error())
		return
	}
	holder[pick.Name] = l.Name
	l.Status.ExporterRef = &corev1.LocalObjectReference{Name: pick.Name}
	l.Status.BeginTime = &metav1.Time{Time: now}
	meta.SetStatusCondition(&l.Status.Conditions, metav1.Condition{Type: jsv1.LeaseConditionReady, Status: metav1.ConditionTrue, Reason: "Ready", Message: "An exporter has been acquired for the client"})
}

// allowDisabled: Lease spec.allowDisabled is not in the minimal types; a
// lease naming a disabled exporter is refused, as upstream's default.
func allowDisabled(*jsv1.Lease) bool { return false }
