package chaos

import (
	"fmt"
	"html"
	"math"
	"strings"
	"time"
)

// SVG plots answers per second (ok, refused, unknown) over the run, with
// each applied fault shaded over its window and named in a lane above the
// plot. It is written by hand so that the report needs nothing installed.
func (r *Report) SVG() []byte {
	const (
		width, left, right, bottom = 1000.0, 56.0, 16.0, 44.0
		laneH, plotH, titleH       = 15.0, 260.0, 28.0
	)
	seconds := math.Max(float64(len(r.Series)), r.Duration.Seconds())
	for _, w := range r.Applied {
		seconds = math.Max(seconds, float64(w.End)/1e9)
	}
	seconds = math.Max(seconds, 1)
	// Lanes: each fault label goes in the first lane where it does not
	// overlap the one before.
	x := func(sec float64) float64 { return left + (width-left-right)*sec/seconds }
	var laneEnd []float64
	lanes := make([]int, len(r.Applied))
	for i, w := range r.Applied {
		x0 := x(float64(w.Start) / 1e9)
		label := labelOf(w.Kind, w.Node)
		x1 := math.Max(x(float64(w.End)/1e9), x0+float64(len(label))*6.6+8)
		l := 0
		for l < len(laneEnd) && laneEnd[l] > x0 {
			l++
		}
		if l == len(laneEnd) {
			laneEnd = append(laneEnd, 0)
		}
		laneEnd[l], lanes[i] = x1, l
	}
	top := titleH + laneH*float64(len(laneEnd)) + 6
	height := top + plotH + bottom
	maxY := 1
	for _, b := range r.Series {
		maxY = max(maxY, b.OK, b.Refused, b.Unknown)
	}
	yTop := niceCeil(float64(maxY))
	y := func(v float64) float64 { return top + plotH - plotH*v/yTop }

	var s strings.Builder
	fmt.Fprintf(&s, `<svg xmlns="http://www.w3.org/2000/svg" width="%.0f" height="%.0f" viewBox="0 0 %.0f %.0f" font-family="sans-serif" font-size="11">`+"\n",
		width, height, width, height)
	s.WriteString(`<rect width="100%" height="100%" fill="white"/>` + "\n")
	verdict := "every invariant held"
	if r.Violated() {
		verdict = "VIOLATIONS FOUND"
	}
	fmt.Fprintf(&s, `<text x="%.0f" y="18" font-size="13" font-weight="bold">quotaring chaos, seed %d, %d nodes: answers per second, faults shaded (%s)</text>`+"\n",
		left, r.Seed, r.Nodes, verdict)
	for i, w := range r.Applied {
		x0, x1 := x(float64(w.Start)/1e9), x(float64(w.End)/1e9)
		if x1-x0 < 2 {
			x1 = x0 + 2
		}
		c := faultColor(Fault(w.Kind))
		fmt.Fprintf(&s, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s" fill-opacity="0.45"><title>%s %s-%s</title></rect>`+"\n",
			x0, top, x1-x0, plotH, c, html.EscapeString(labelOf(w.Kind, w.Node)), clock(time.Duration(w.Start)), clock(time.Duration(w.End)))
		ly := titleH + laneH*float64(lanes[i])
		fmt.Fprintf(&s, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s"/>`+"\n", x0, ly, math.Max(x1-x0, 2), laneH-3, c)
		fmt.Fprintf(&s, `<text x="%.1f" y="%.1f">%s</text>`+"\n", x0+2, ly+laneH-6, html.EscapeString(labelOf(w.Kind, w.Node)))
	}
	// Axes and grid.
	ticks := 4 // 1 and 2 split in quarters, 2.5 and 5 in fifths
	if m := yTop / math.Pow(10, math.Floor(math.Log10(yTop))); m == 2.5 || m == 5 {
		ticks = 5
	}
	for i := 0; i <= ticks; i++ {
		v := yTop * float64(i) / float64(ticks)
		fmt.Fprintf(&s, `<line x1="%.0f" x2="%.0f" y1="%.1f" y2="%.1f" stroke="#ddd"/>`+"\n", left, width-right, y(v), y(v))
		fmt.Fprintf(&s, `<text x="%.0f" y="%.1f" text-anchor="end">%.0f</text>`+"\n", left-4, y(v)+4, v)
	}
	step := niceStep(seconds / 10)
	for t := 0.0; t <= seconds; t += step {
		fmt.Fprintf(&s, `<line x1="%.1f" x2="%.1f" y1="%.0f" y2="%.0f" stroke="#999"/>`+"\n", x(t), x(t), top+plotH, top+plotH+4)
		fmt.Fprintf(&s, `<text x="%.1f" y="%.0f" text-anchor="middle">%d:%02d</text>`+"\n", x(t), top+plotH+16, int(t)/60, int(t)%60)
	}
	fmt.Fprintf(&s, `<line x1="%.0f" x2="%.0f" y1="%.0f" y2="%.0f" stroke="#333"/>`+"\n", left, width-right, top+plotH, top+plotH)
	fmt.Fprintf(&s, `<line x1="%.0f" x2="%.0f" y1="%.0f" y2="%.0f" stroke="#333"/>`+"\n", left, left, top, top+plotH)
	fmt.Fprintf(&s, `<text x="%.0f" y="%.0f" text-anchor="middle">time since the workload began (m:ss)</text>`+"\n", (left+width)/2, height-8)
	fmt.Fprintf(&s, `<text transform="translate(14 %.0f) rotate(-90)" text-anchor="middle">answers / s</text>`+"\n", top+plotH/2)
	series := []struct {
		name, color string
		v           func(Bucket) int
	}{
		{"ok", "#2a9d3f", func(b Bucket) int { return b.OK }},
		{"refused", "#e09f1f", func(b Bucket) int { return b.Refused }},
		{"unknown", "#d62828", func(b Bucket) int { return b.Unknown }},
	}
	for i, sr := range series {
		var pts []string
		for _, b := range r.Series {
			pts = append(pts, fmt.Sprintf("%.1f,%.1f", x(float64(b.T)+0.5), y(float64(sr.v(b)))))
		}
		fmt.Fprintf(&s, `<polyline fill="none" stroke="%s" stroke-width="1.5" points="%s"/>`+"\n", sr.color, strings.Join(pts, " "))
		lx := width - right - 220 + float64(i)*72
		fmt.Fprintf(&s, `<line x1="%.0f" x2="%.0f" y1="%.0f" y2="%.0f" stroke="%s" stroke-width="3"/>`+"\n", lx, lx+16, top+10, top+10, sr.color)
		fmt.Fprintf(&s, `<text x="%.0f" y="%.0f">%s</text>`+"\n", lx+20, top+14, sr.name)
	}
	s.WriteString("</svg>\n")
	return []byte(s.String())
}

func labelOf(kind, node string) string {
	if node == "" {
		return kind
	}
	return kind + " " + node
}

func faultColor(f Fault) string {
	switch f.class() {
	case "node-down":
		return "#8ecae6"
	case "network":
		return "#ffb4a2"
	case "ledger":
		return "#cdb4db"
	case "clock", "clock-start":
		return "#ffe066"
	}
	return "#b7e4c7"
}

// niceCeil rounds v up to 1, 2, 2.5 or 5 times a power of ten.
func niceCeil(v float64) float64 {
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 2.5, 5, 10} {
		if m*p >= v {
			return m * p
		}
	}
	return 10 * p
}

// niceStep rounds a tick step to 1, 2, 5, 10, 15 or 30 seconds, or whole
// minutes.
func niceStep(v float64) float64 {
	for _, s := range []float64{1, 2, 5, 10, 15, 30, 60, 120, 300, 600} {
		if s >= v {
			return s
		}
	}
	return 600
}
