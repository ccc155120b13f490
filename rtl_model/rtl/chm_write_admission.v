// chm_write_admission: write-buffer admission and the flush arbiter.
//
// Admission (reference: emulator/write_buffer.py::WriteAdmission) is a
// serialized, all-or-nothing check-and-reserve: a request for PAGES pages is
// admitted and reserved if they all fit the free write-buffer pages, else it
// is refused and nothing is reserved. Space returns on the release stream
// when a flush of those pages completes. When a release and an admission
// move in the same cycle, the release counts first.
//
// The arbiter (reference: emulator/write_buffer.py::FlushArbiter) answers each
// grant request with how many dirty pages may go to the SSDs now (0: not now):
// with force (flush, shutdown) min(dirty, BATCH_PAGES) regardless of reads;
// otherwise nothing while more than MAX_READS reads are in flight
// (read-prioritized), a full batch of BATCH_PAGES once that many are dirty,
// all dirty pages once the oldest has waited MAX_DELAY (age units are the
// caller's: the bench uses controller cycles), else nothing.
//
// Timing: each stream decides in the cycle its request is accepted and
// presents the answer the next cycle: one admission and one grant per cycle.
//
// Parameters
//   CAPACITY_PAGES  write-buffer pages (>= 1, < 2**COUNT_W)
//   PAGES_W         width of a request's / release's page count
//   COUNT_W         width of the reserved-page counter (> PAGES_W)
//   BATCH_PAGES     flush batch size in pages;  MAX_READS  reads in flight that still allow a flush
//   MAX_DELAY       age after which a partial batch goes
//   DIRTY_W, READS_W, AGE_W   widths of the arbiter's inputs
//   FAULT           test-only fault injection: 0 none; 1 a request that fits the
//                   free pages exactly is refused (off-by-one)
//
// Ports (valid/ready streams; a beat moves when valid && ready at a clock edge)
//   clk, rst                   clock, synchronous active-high reset
//   admission requests (in)
//     adm_valid, adm_ready  1, 1
//     adm_pages      PAGES_W   pages the write needs in the buffer
//   admission results (out), one per request, in order
//     res_valid, res_ready  1, 1
//     res_admitted   1         1: reserved; 0: refused, nothing reserved
//     res_free       COUNT_W   free pages after this decision
//   releases (in): a flush of rel_pages pages completed (never back-pressured)
//     rel_valid, rel_ready  1, 1
//     rel_pages      PAGES_W
//   grant requests (in)
//     arb_valid, arb_ready  1, 1
//     arb_dirty      DIRTY_W   dirty pages waiting for a flush
//     arb_reads      READS_W   SSD reads in flight
//     arb_age        AGE_W     age of the oldest dirty page
//     arb_force      1         flush/shutdown: drain regardless of reads
//   grants (out), one per request, in order
//     gnt_valid, gnt_ready  1, 1
//     gnt_pages      DIRTY_W   pages to flush now (0: not now)

`resetall
`timescale 1ns / 1ps
`default_nettype none

module chm_write_admission #(
    parameter integer CAPACITY_PAGES = 64,
    parameter integer PAGES_W = 8,
    parameter integer COUNT_W = 16,
    parameter integer BATCH_PAGES = 16,
    parameter integer MAX_READS = 0,
    parameter integer MAX_DELAY = 100,
    parameter integer DIRTY_W = 16,
    parameter integer READS_W = 8,
    parameter integer AGE_W = 16,
    parameter integer FAULT = 0
) (
    input  wire               clk,
    input  wire               rst,

    input  wire               adm_valid,
    output wire               adm_ready,
    input  wire [PAGES_W-1:0] adm_pages,

    output reg                res_valid,
    input  wire               res_ready,
    output reg                res_admitted,
    output reg  [COUNT_W-1:0] res_free,

    input  wire               rel_valid,
    output wire               rel_ready,
    input  wire [PAGES_W-1:0] rel_pages,

    input  wire               arb_valid,
    output wire               arb_ready,
    input  wire [DIRTY_W-1:0] arb_dirty,
    input  wire [READS_W-1:0] arb_reads,
    input  wire [AGE_W-1:0]   arb_age,
    input  wire               arb_force,

    output reg                gnt_valid,
    input  wire               gnt_ready,
    output reg  [DIRTY_W-1:0] gnt_pages
);

// page counts never exceed CAPACITY_PAGES, so the counter width suffices
localparam integer CW = COUNT_W;
localparam [CW-1:0] CAPACITY = CAPACITY_PAGES[CW-1:0];
localparam [DIRTY_W-1:0] BATCH = BATCH_PAGES[DIRTY_W-1:0];
localparam [READS_W-1:0] READS_LIMIT = MAX_READS[READS_W-1:0];
localparam [AGE_W-1:0] DELAY = MAX_DELAY[AGE_W-1:0];

initial begin
    if (PAGES_W >= COUNT_W || CAPACITY_PAGES < 1 || CAPACITY_PAGES >= (1 << COUNT_W) || BATCH_PAGES < 1 || BATCH_PAGES >= (1 << DIRTY_W)
            || MAX_READS < 0 || MAX_READS >= (1 << READS_W) || MAX_DELAY < 0 || MAX_DELAY >= (1 << AGE_W)) begin
        $error("chm_write_admission: PAGES_W=%0d must be < COUNT_W=%0d; CAPACITY_PAGES=%0d, BATCH_PAGES=%0d, MAX_READS=%0d, MAX_DELAY=%0d out of range for their widths",
               PAGES_W, COUNT_W, CAPACITY_PAGES, BATCH_PAGES, MAX_READS, MAX_DELAY);
        $finish;
    end
end

// ---- admission ----
reg  [CW-1:0] used;   // reserved pages

assign adm_ready = !res_valid || res_ready;
assign rel_ready = 1'b1;

wire          adm_fire = adm_valid && adm_ready;
wire [CW-1:0] rel_req = rel_valid ? {{(CW - PAGES_W){1'b0}}, rel_pages} : {CW{1'b0}};
wire [CW-1:0] rel_amount = rel_req > used ? used : rel_req;  // never below zero
wire [CW-1:0] used_after_rel = used - rel_amount;
wire [CW-1:0] free_after_rel = CAPACITY - used_after_rel;
wire [CW-1:0] req = {{(CW - PAGES_W){1'b0}}, adm_pages};
wire          fits = FAULT == 1 ? req < free_after_rel : req <= free_after_rel;
wire [CW-1:0] used_next = used_after_rel + (adm_fire && fits ? req : {CW{1'b0}});
wire [CW-1:0] free_next = CAPACITY - used_next;

// ---- arbiter ----
assign arb_ready = !gnt_valid || gnt_ready;
wire arb_fire = arb_valid && arb_ready;

reg [DIRTY_W-1:0] grant;
always @* begin
    if (arb_dirty == {DIRTY_W{1'b0}}) grant = {DIRTY_W{1'b0}};
    else if (arb_force) grant = arb_dirty < BATCH ? arb_dirty : BATCH;
    else if (arb_reads > READS_LIMIT) grant = {DIRTY_W{1'b0}};
    else if (arb_dirty >= BATCH) grant = BATCH;
    else if (arb_age >= DELAY) grant = arb_dirty;
    else grant = {DIRTY_W{1'b0}};
end

always @(posedge clk) begin
    used <= used_next;
    if (adm_fire) begin
        res_valid <= 1'b1;
        res_admitted <= fits;
        res_free <= free_next;
    end else if (res_ready) begin
        res_valid <= 1'b0;
    end

    if (arb_fire) begin
        gnt_valid <= 1'b1;
        gnt_pages <= grant;
    end else if (gnt_ready) begin
        gnt_valid <= 1'b0;
    end

    if (rst) begin
        used <= {CW{1'b0}};
        res_valid <= 1'b0;
        gnt_valid <= 1'b0;
    end
end

endmodule

`resetall
